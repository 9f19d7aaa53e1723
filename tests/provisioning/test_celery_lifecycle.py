"""The lifecycle end to end through a real Celery worker process on real Redis (simulated backend)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from portal.core.models import AuditLog
from provisioning import services
from provisioning.choices import PROVISION_PHASES
from provisioning.models import ClusterTransition, VirtualCluster
from reservations.models import Reservation
from reservations.services import reservation_cancel

from .conftest import book, now_slot, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]


def status_of(model, pk):
    return model.objects.filter(pk=pk).values_list("status", flat=True).first()


def test_booking_to_ready_to_active_to_completed_through_the_worker(world, prov_worker):
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=2, nodes=2)  # the event creates the cluster on commit
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert cluster.status == "pending"

    services.lifecycle_tick()  # what beat runs every minute: dispatches provisioning to the worker
    wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "ready", timeout=60,
             what=f"cluster ready; worker log:\n{prov_worker.output()[-3000:]}")
    wait_for(lambda: status_of(Reservation, reservation.pk) == "active", timeout=10, what="reservation active")
    phases = list(ClusterTransition.objects.filter(cluster=cluster).order_by("at", "id")
                  .values_list("phase", flat=True))
    assert phases == ["pending", *PROVISION_PHASES, "ready"]
    assert "provisioning.provision_cluster" in prov_worker.output()

    services.lifecycle_tick(now=start + timedelta(hours=2))  # the end: ending, teardown dispatched
    wait_for(lambda: status_of(Reservation, reservation.pk) == "completed", timeout=60,
             what=f"reservation completed; worker log:\n{prov_worker.output()[-3000:]}")
    assert status_of(VirtualCluster, cluster.pk) == "deleted"
    assert list(AuditLog.objects.filter(object_type="reservations.reservation", object_id=str(reservation.pk))
                .exclude(action="reservation.starting_soon").order_by("created_at", "id")
                .values_list("action", flat=True)) == [
        "reservation.create", "reservation.provisioning", "reservation.active", "reservation.ending",
        "reservation.completed"]
    # The worker handled a private key; its log must not show it.
    assert "PRIVATE KEY" not in prov_worker.output()


def test_many_bookings_at_once_each_reach_ready_exactly_once(world, prov_worker):
    start = now_slot(world)
    reservations = [book(world, who, start, hours=1) for who in ("alpha-lead", "alpha-member", "beta-lead",
                                                                   "beta-member")]
    services.lifecycle_tick()
    services.lifecycle_tick()  # a second tick at once (beat and a retried tick): nothing twice
    ids = [r.pk for r in reservations]
    wait_for(lambda: Reservation.objects.filter(pk__in=ids, status="active").count() == 4, timeout=60,
             what=f"all active; worker log:\n{prov_worker.output()[-3000:]}")
    for reservation in reservations:
        cluster = VirtualCluster.objects.get(reservation=reservation)
        assert ClusterTransition.objects.filter(cluster=cluster, phase="ready").count() == 1
        assert AuditLog.objects.filter(object_id=str(reservation.pk), action="reservation.provisioning").count() == 1


def test_cancel_event_tears_down_through_the_worker(world, prov_worker):
    start = now_slot(world)
    reservation = book(world, "beta-lead", start, hours=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "ready", timeout=60, what="ready")
    reservation_cancel(actor=world.users["beta-lead"], reservation=reservation)  # event → teardown task
    wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "deleted", timeout=60,
             what=f"deleted; worker log:\n{prov_worker.output()[-3000:]}")
    assert status_of(Reservation, reservation.pk) == "cancelled"


def test_provisioning_that_finds_the_cluster_busy_asks_again_soon(world, prov_worker):
    """The provisioning message arrives while a booking sync or node swap holds the cluster's lock: the
    worker asks again a few seconds later (it used to drop the message, and the cluster waited for the
    tick's resend, PORTAL_PROVISIONING_REDISPATCH_SECONDS later, while the booking had already started)."""
    from portal.core.locks import advisory_lock
    from provisioning.constants import LOCK_CLUSTER

    reservation = book(world, "alpha-lead", now_slot(world), hours=2)
    cluster = VirtualCluster.objects.get(reservation=reservation)
    mark = len(prov_worker.output())
    with advisory_lock(LOCK_CLUSTER, cluster.pk) as held:  # a booking sync elsewhere (this connection)
        assert held
        services.lifecycle_tick()  # dispatches provisioning to the worker, which finds the cluster busy
        wait_for(lambda: "provisioning.provision_cluster" in prov_worker.output()[mark:]
                 and ("'busy'" in prov_worker.output()[mark:] or "retry" in prov_worker.output()[mark:]),
                 timeout=30, what=f"provisioning found busy; worker log:\n{prov_worker.output()[-3000:]}")
        assert status_of(VirtualCluster, cluster.pk) == "pending"
    # No tick runs: the task's own retry provisions the cluster once the sync let go.
    wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "ready", timeout=30,
             what=f"cluster ready without a resend; worker log:\n{prov_worker.output()[-3000:]}")
