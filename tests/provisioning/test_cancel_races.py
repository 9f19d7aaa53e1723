"""The tenant cancels while the provisioning run builds the cluster: real threads on the real database."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from provisioning import services
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.choices import ReservationStatus
from reservations.models import Allocation
from reservations.services import reservation_cancel
from tests.provisioning.conftest import book, now_slot

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_cancel_during_a_provisioning_phase_stops_the_run_before_the_hand_over(world, monkeypatch,
                                                                                 captured_events):
    """The team cancels its starting booking while the run is in a backend call (installing drivers, the
    cluster's row not locked): the cancel commits at once and frees the nodes; the teardown the cancel sends
    finds the run holding the cluster and is told busy; the run, at its next step, sees the cancel and stops —
    the cluster never becomes ready, the booking never active, no "cluster ready" goes out — and the teardown
    that follows removes it. Passed on the code as it was; this interleaving had no test."""
    reservation = book(world, "alpha-lead", now_slot(world), hours=4, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    real = SimulatedBackend.install_drivers
    seen: dict = {}

    def cancel_in_another_worker():
        try:
            seen["cancel"] = reservation_cancel(actor=world.users["alpha-lead"], reservation=reservation)
            seen["teardown"] = services.cluster_teardown(cluster_id=cluster.pk)  # the cancel's task, at once
        except Exception as exc:  # noqa: BLE001 - asserted below
            seen["error"] = exc
        finally:
            connection.close()

    def install_while_the_team_cancels(self, ctx):
        if not seen:
            worker = threading.Thread(target=cancel_in_another_worker)
            worker.start()
            worker.join(30)
        return real(self, ctx)

    monkeypatch.setattr(SimulatedBackend, "install_drivers", install_while_the_team_cancels)
    assert services.cluster_provision(cluster_id=cluster.pk) == "stopped"
    assert "error" not in seen, seen.get("error")
    assert seen["cancel"].status == ReservationStatus.CANCELLED and seen["teardown"] == "busy"
    cluster.refresh_from_db()
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.CANCELLED
    assert cluster.status == ClusterStatus.INSTALLING_DRIVERS
    assert not cluster.transitions.filter(phase=ClusterStatus.READY).exists()
    assert not [n for n, p in captured_events if n == "cluster.ready"]
    assert not Allocation.objects.filter(reservation=reservation, active=True).exists()
    # The teardown asked again (its retry, or the tick's resend) removes what the run built.
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.CANCELLED
