"""A window change the backend refuses for good, on a live cluster (found in a review of the provisioning side;
the test failed on the code before its fix)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from notifications import selectors as notification_selectors
from notifications.slack import build_message
from provisioning import services
from provisioning.backends.base import BackendError
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.services import reservation_update
from tests.provisioning.conftest import book, now_slot

pytestmark = pytest.mark.django_db

REFUSAL = "Slurm: Requested reservation is invalid (node h100-001 is held by maint-7)"


def _refusing(monkeypatch):
    def refuse(self, ctx):
        raise BackendError(REFUSAL, transient=False)

    monkeypatch.setattr(SimulatedBackend, "update_window", refuse)


def _extension_refused(world, reservation, monkeypatch, django_capture_on_commit_callbacks):
    """Extend the booking by two hours and have the backend refuse that window for good; return the new end."""
    new_end = reservation.period.upper + timedelta(hours=2)
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=new_end)
    _refusing(monkeypatch)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.reservation_sync(reservation_id=reservation.pk) == "refused"
    return new_end


def test_a_window_change_the_backend_refuses_degrades_the_cluster_and_tells_the_team(
        world, captured_events, monkeypatch, django_capture_on_commit_callbacks):
    """An extension the backend refused for good (a live cluster) was only logged: the portal showed the new end
    while the backend kept the old one, so the team's jobs would be stopped at the old end and nobody was told.
    The cluster is now degraded with the reason (as a failed node swap is), and cluster.degraded tells the team
    and the platform channel; the redelivered sync tells nobody twice, and a later change the backend accepts
    gives the cluster back as ready."""
    reservation = book(world, "alpha-lead", now_slot(world), hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    new_end = _extension_refused(world, reservation, monkeypatch, django_capture_on_commit_callbacks)
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.DEGRADED
    assert "refused" in cluster.status_reason and REFUSAL in cluster.status_reason
    assert new_end.strftime("%Y-%m-%d %H:%M") in cluster.status_reason
    degraded = [payload for name, payload in captured_events if name == "cluster.degraded"]
    assert len(degraded) == 1 and degraded[0]["reason"] == cluster.status_reason

    # What the team's and the platform's channels get: the reason, not a node story.
    notices = notification_selectors.notices_for("cluster.degraded", degraded[0])
    assert notices and notices[0].tenant_id == reservation.tenant_id and notices[0].to_platform
    text = "\n".join(str(block) for block in build_message(notices[0].event, notices[0].payload,
                                                           "https://portal.example.com")["blocks"])
    assert "refused" in text and "no spare was free" not in text

    # The sync runs again (the outbox redelivers it): the same refusal is not a second transition or message.
    transitions = cluster.transitions.count()
    with django_capture_on_commit_callbacks(execute=True):
        assert services.reservation_sync(reservation_id=reservation.pk) == "refused"
    assert cluster.transitions.count() == transitions
    assert len([name for name, _ in captured_events if name == "cluster.degraded"]) == 1

    # The backend takes the window again (the team changed it once more, or staff cleared the cause): ready.
    monkeypatch.undo()
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=new_end - timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.READY and cluster.status_reason == "the backend holds the window again"


def test_a_refused_window_change_keeps_a_cluster_degraded_for_a_lost_node_degraded(
        world, monkeypatch, django_capture_on_commit_callbacks):
    """A cluster already degraded (a node lost with no spare) gets the refusal as its reason, and a later change
    the backend accepts does not make it look whole again."""
    reservation = book(world, "alpha-lead", now_slot(world), hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    services._degrade(cluster.pk, "h100-001 failed and no spare node is free (1 missing)", "h100-001")
    _extension_refused(world, reservation, monkeypatch, django_capture_on_commit_callbacks)
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.DEGRADED and REFUSAL in cluster.status_reason
    monkeypatch.undo()
    with django_capture_on_commit_callbacks(execute=True):
        assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.DEGRADED


def _slack_text(event: str, payload: dict) -> tuple[str, str]:
    """(the notification's fallback text, its blocks as text) for a domain event, as a channel gets them."""
    notices = notification_selectors.notices_for(event, payload)
    assert len(notices) == 1
    message = build_message(notices[0].event, notices[0].payload, "https://portal.example.com")
    return message["text"], "\n".join(str(block) for block in message["blocks"])


def test_the_recovery_from_a_refused_window_change_says_so_and_not_that_a_cluster_was_built(
        world, captured_events, monkeypatch, django_capture_on_commit_callbacks):
    """The cluster back to ready after a refused window change sent the team the message a newly built cluster
    gets ("Cluster ready … health checks passed, go ahead", with the access details again), which reads as if a
    new cluster had been built. It now says the cluster is back to normal and the backend holds its window."""
    reservation = book(world, "alpha-lead", now_slot(world), hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    built = [payload for name, payload in captured_events if name == "cluster.ready"]
    assert len(built) == 1 and not built[0].get("recovered")
    text, blocks = _slack_text("cluster.ready", built[0])
    assert text.startswith("Cluster ready:") and "health checks passed, go ahead" in blocks
    assert "Access" in blocks

    new_end = _extension_refused(world, reservation, monkeypatch, django_capture_on_commit_callbacks)
    monkeypatch.undo()
    with django_capture_on_commit_callbacks(execute=True):
        assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.READY

    recovered = [payload for name, payload in captured_events if name == "cluster.ready"][1:]
    assert len(recovered) == 1 and recovered[0]["recovered"] is True
    text, blocks = _slack_text("cluster.ready", recovered[0])
    assert text.startswith("Cluster back to normal:"), text
    assert "back to normal" in blocks and "holds the booking's window" in blocks and "not rebuilt" in blocks
    assert "Cluster ready" not in text + blocks and "go ahead" not in blocks and "Access" not in blocks
    assert "*Ends*" in blocks and new_end.strftime("%Y-%m-%dT%H:%M:%SZ") in blocks  # the window it now holds
