"""A cluster event the outbox hands over late (a subscriber failed, a worker died: it is retried minutes later) is
named by its own transition, not by whichever transition of its phase is the newest by then."""

from __future__ import annotations

from datetime import timedelta

import pytest

from notifications import services
from notifications.models import Delivery
from notifications.slack import Event
from provisioning import services as provisioning
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"


def test_a_ready_event_told_late_does_not_swallow_the_later_back_to_normal(
        world, t0, book, slack_for, settings, django_capture_on_commit_callbacks, captured_events):
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    settings.PORTAL_SIMULATED_PHASE_SECONDS = "0"
    reservation = book("alpha", t0)
    with django_capture_on_commit_callbacks(execute=True):
        provisioning.lifecycle_tick(now=t0 - timedelta(minutes=10))
        cluster = VirtualCluster.objects.get(reservation=reservation)
        assert provisioning.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
        # Later the backend refuses a window change (degraded), then takes it (ready again: back to normal).
        provisioning._window_refused(cluster.pk, provisioning.build_context(cluster.pk), "refused")
        provisioning._window_held(cluster.pk)
    built, recovered = [p for name, p in captured_events if name == "cluster.ready"]
    assert recovered.get("recovered") and not built.get("recovered")
    slack_for("alpha", SLACK_URL, events=[Event.CLUSTER_READY])

    # The first cluster.ready reaches notifications only now (its outbox row was retried), then the second.
    (ready,) = services.event_fanout(event="cluster.ready", payload=built)
    (back,) = services.event_fanout(event="cluster.ready", payload=recovered)

    assert "Cluster ready" in ready.summary
    assert "back to normal" in back.summary  # was dropped: both were named by the newest ready transition
    assert services.event_fanout(event="cluster.ready", payload=built) == []  # and again: nothing more
    assert Delivery.objects.filter(event=Event.CLUSTER_READY).count() == 2
