"""A Kubernetes token capped below the booking is renewed by the lifecycle tick (reservation_sync) and the tenant's
kubeconfig replaced: the team is told, since the kubeconfig they downloaded stops working when its token expires."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from notifications import services, signing
from notifications.choices import DeliveryStatus
from notifications.models import Delivery
from notifications.slack import Event
from portal.core.timefmt import format_utc
from provisioning import services as provisioning
from provisioning.models import ClusterCredential, VirtualCluster
from tests.k8s.conftest import api_server  # noqa: F401 - the loopback Kubernetes API server fixture
from tests.provisioning.conftest import book as book_cluster
from tests.provisioning.conftest import loopback_k8s

pytestmark = pytest.mark.django_db


def test_a_renewed_kubeconfig_is_told_to_the_team_and_only_to_it(
        world, t0, api_server, tmp_path, settings, receiver, webhook_for,  # noqa: F811 - the imported fixture
        django_capture_on_commit_callbacks, captured_events):
    notify_settings = settings
    notify_settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.05
    k8s = loopback_k8s(api_server, world, tmp_path, settings, backend="slurm,kubernetes")
    k8s.token_max_seconds = 3600  # the API server caps tokens below the booking's window
    channel, secret = webhook_for("alpha", receiver.url("/alpha"))  # the default events
    webhook_for("alpha", receiver.url("/alpha-ready-only"), events=[Event.CLUSTER_READY])
    webhook_for("beta", receiver.url("/beta"))
    reservation = book_cluster(world, "alpha-lead", t0, hours=4, nodes=2, orchestrator="kubernetes")
    provisioning.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert provisioning.cluster_provision(cluster_id=cluster.pk) == "ready"
    cluster.refresh_from_db()
    old_expiry = datetime.fromisoformat(cluster.backend_state["token_expires_at"])
    first = ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig")

    with django_capture_on_commit_callbacks(execute=True):  # the renewal the tick asks for
        assert provisioning.reservation_sync(reservation_id=reservation.pk) == "updated"

    assert ClusterCredential.objects.current().get(cluster=cluster, kind="kubeconfig").pk != first.pk
    cluster.refresh_from_db()
    (renewed,) = [p for name, p in captured_events if name == "cluster.credentials_renewed"]
    assert renewed["cluster_id"] == cluster.pk and renewed["tenant_id"] == reservation.tenant_id
    assert renewed["previous_expires_at"] == old_expiry.isoformat()
    assert renewed["expires_at"] == cluster.backend_state["token_expires_at"]

    (delivery,) = Delivery.objects.filter(event=Event.CLUSTER_CREDENTIALS_RENEWED)
    assert delivery.channel_id == channel.pk  # not the channel that unticked it, nor another team's
    assert services.delivery_send(delivery_id=delivery.pk).status == DeliveryStatus.DELIVERED
    (request,) = receiver.wait_for(1)
    assert request.path == "/alpha"
    assert signing.verify(secret, request.body, request.headers) == request.headers["webhook-id"]
    sent = request.json()
    assert sent["type"] == "cluster.credentials_renewed"
    data = sent["data"]
    assert data["cluster_id"] == cluster.pk and data["reservation_id"] == reservation.pk
    assert data["previous_expires_at"] == format_utc(old_expiry)
    assert data["expires_at"] == format_utc(datetime.fromisoformat(cluster.backend_state["token_expires_at"]))
    assert "token" not in json.dumps(data).replace("expires_at", "")  # never the kubeconfig itself
    assert "kubeconfig" in delivery.summary

    # The event again (the outbox redelivers it): nothing more is sent.
    assert services.event_fanout(event="cluster.credentials_renewed", payload=renewed) == []
    assert Delivery.objects.filter(event=Event.CLUSTER_CREDENTIALS_RENEWED).count() == 1


def test_the_first_kubeconfig_of_a_new_cluster_is_no_renewal(world, t0, api_server, tmp_path,  # noqa: F811
                                                            settings, django_capture_on_commit_callbacks,
                                                            captured_events):
    loopback_k8s(api_server, world, tmp_path, settings, backend="slurm,kubernetes")
    reservation = book_cluster(world, "alpha-lead", t0, hours=4, nodes=2, orchestrator="kubernetes")
    with django_capture_on_commit_callbacks(execute=True):
        provisioning.lifecycle_tick(now=t0 - timedelta(minutes=10))
        cluster = VirtualCluster.objects.get(reservation=reservation)
        assert provisioning.cluster_provision(cluster_id=cluster.pk) == "ready"
    names = [name for name, _ in captured_events]
    assert "cluster.ready" in names and "cluster.credentials_renewed" not in names


def test_channels_made_before_the_event_existed_hear_it_when_they_hear_of_their_cluster(world, webhook_for,
                                                                                        notify_settings):
    import importlib

    from django.db import connection

    migration = importlib.import_module("notifications.migrations.0002_channel_events_credentials_renewed")
    before = [e for e in services.SUBSCRIBABLE_EVENTS if e != Event.CLUSTER_CREDENTIALS_RENEWED]
    hears, _ = webhook_for("alpha", "https://ci.example.com/a", events=before)
    deaf, _ = webhook_for("alpha", "https://ci.example.com/b", events=[Event.RESERVATION_CONFIRMED])
    with connection.schema_editor() as editor:
        migration.forwards(None, editor)
        migration.forwards(None, editor)  # twice: once in the list
    hears.refresh_from_db()
    deaf.refresh_from_db()
    assert hears.events == [*before, Event.CLUSTER_CREDENTIALS_RENEWED]
    assert deaf.events == [Event.RESERVATION_CONFIRMED]
