"""Interleavings of provisioning, teardown, staff retry and node swaps on the real database (found in a
review of the background side; each test failed on the code before its fix)."""

from datetime import timedelta

import pytest

from provisioning import services
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.choices import ReservationStatus
from reservations.models import Allocation, Node
from reservations.services import node_update
from tests.provisioning.conftest import book

pytestmark = pytest.mark.django_db


def _failed_booking(world, t0, settings):
    settings.PORTAL_PROVISIONING_FAULTS = "attaching_storage=fatal"
    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.FAILED
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.FAILED
    settings.PORTAL_PROVISIONING_FAULTS = ""
    return reservation, cluster


def test_staff_retry_moves_the_booking_off_a_node_drained_since_it_failed(world, t0, settings):
    reservation, cluster = _failed_booking(world, t0, settings)
    node = Node.objects.get(allocations__reservation=reservation)
    # The node fails its health check meanwhile and is drained; nothing active is on it to move.
    node_update(actor=None, node=node, state="draining", reason="health check #7 failed")
    assert services.node_sync(node_id=node.pk) == {}
    services.cluster_retry(actor=world.users["staff"], cluster=cluster)
    held = list(Allocation.objects.filter(reservation=reservation, active=True).values_list("node__state", flat=True))
    assert held == ["available"]
    old = Allocation.objects.get(reservation=reservation, node=node)
    assert not old.active and old.note.startswith("replaced at ") and "is draining" in old.note
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.CONFIRMED


def test_staff_retry_with_no_spare_for_a_drained_node_changes_nothing(world, t0, settings):
    reservation, cluster = _failed_booking(world, t0, settings)
    node = Node.objects.get(allocations__reservation=reservation)
    node_update(actor=None, node=node, state="draining", reason="xid 79")
    for other in Node.objects.exclude(pk=node.pk):
        node_update(actor=None, node=other, state="failed", reason="rack down")
    with pytest.raises(Exception, match="no spare is free"):
        services.cluster_retry(actor=world.users["staff"], cluster=cluster)
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.FAILED
    assert not Allocation.objects.filter(reservation=reservation, active=True).exists()
    assert Allocation.objects.get(reservation=reservation, node=node).note == ""  # nothing written
