"""Lifecycle defects found in a review of provisioning (reservation ⇄ cluster ⇄ node); each test failed on the
code before its fix."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core.exceptions import CapacityUnavailable, InvalidState
from provisioning import services, tasks
from provisioning.backends import k8s_manifests as m
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.choices import NodeState, ReservationStatus
from reservations.models import Allocation, Node
from reservations.services import maintenance_window_create, reservation_update
from tests.k8s.conftest import api_server  # noqa: F401 - the loopback fixture

from .conftest import book, loopback_k8s

pytestmark = pytest.mark.django_db


@pytest.fixture
def k8s(api_server, world, tmp_path, settings):  # noqa: F811 - the imported fixture
    return loopback_k8s(api_server, world, tmp_path, settings, backend="kubernetes")


def _claimed_by(k8s, reservation_id: int) -> set[str]:
    return {host for host, node in k8s.nodes.items()
            if node["metadata"].get("labels", {}).get(m.RESERVATION_LABEL) == str(reservation_id)}


def _held(reservation) -> set[str]:
    return set(Allocation.objects.filter(reservation=reservation, active=True).values_list("node__hostname",
                                                                                            flat=True))


def test_a_window_change_while_provisioning_never_moves_the_booking_off_the_nodes_its_cluster_claimed(
        world, t0, k8s):
    """A reservation whose cluster is being built (or built, waiting for its start) keeps its nodes.

    Before: it was treated like any booking not yet begun — an extension into a window where one of its
    nodes is busy moved it whole to other nodes, and a later start freed its nodes in the gap. The cluster
    stayed claimed on the old nodes (the backend only re-applies the new set; teardown releases only the
    current one), so those nodes, free in the portal, stayed tainted for this tenant for good, and another
    tenant's cluster booked on them failed.
    """
    reservation = book(world, "alpha-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    reservation.refresh_from_db()
    assert reservation.status == ReservationStatus.PROVISIONING  # ready, its window starts tomorrow
    (host,) = _held(reservation)
    assert _claimed_by(k8s, reservation.pk) == {host}
    node = next(n for n in world.nodes if n.hostname == host)
    maintenance_window_create(actor=world.users["staff"], node=node, start=t0 + timedelta(hours=2),
                              end=t0 + timedelta(hours=4))

    lead = world.users["alpha-lead"]
    with pytest.raises(CapacityUnavailable):
        reservation_update(actor=lead, reservation=reservation, end=t0 + timedelta(hours=4))
    with pytest.raises(InvalidState):
        reservation_update(actor=lead, reservation=reservation, start=t0 + timedelta(hours=5),
                           end=t0 + timedelta(hours=7))
    assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    assert _held(reservation) == {host} == _claimed_by(k8s, reservation.pk)
    reservation.refresh_from_db()
    assert (reservation.period.lower, reservation.period.upper) == (t0, t0 + timedelta(hours=2))

    # What still may change: the end, on the same nodes.
    reservation_update(actor=lead, reservation=reservation, end=t0 + timedelta(hours=1))
    assert services.reservation_sync(reservation_id=reservation.pk) == "updated"
    assert _held(reservation) == {host} == _claimed_by(k8s, reservation.pk)


def test_a_failed_kubernetes_cluster_lets_go_of_the_nodes_its_booking_gave_back(
        world, t0, k8s, settings, monkeypatch, django_capture_on_commit_callbacks):
    """A failed provisioning releases the booking's nodes at once; the backend must let go of them too.

    Before: the cleanup asked the backend to tear down once and ignored "not finished yet" — a namespace
    always takes a moment to terminate, and the nodes' claim is lifted only once it is gone — so the
    namespace's deletion was never followed up and the nodes stayed tainted for the failed tenant until
    its window ended (the tick tears a failed booking down only then), while the portal gave them to others.
    """
    sent: list[tuple[str, tuple]] = []
    monkeypatch.setattr(services, "_send", lambda name, *args, countdown=None: sent.append((name, args)))
    settings.PORTAL_PROVISIONING_FAULTS = "attaching_storage=fatal"
    k8s.terminating_reads = 1  # deleting a namespace takes a moment, as on a real API server
    reservation = book(world, "alpha-lead", t0, hours=3, nodes=1, orchestrator="kubernetes")
    (host,) = _held(reservation)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.cluster_provision(cluster_id=cluster.pk) == "failed"
    settings.PORTAL_PROVISIONING_FAULTS = ""
    assert _held(reservation) == set()  # the portal hands the node to the next booking at once

    # The follow-up message is lost: the tick sends it again.
    sent.clear()
    services.lifecycle_tick(now=timezone.now() + timedelta(minutes=10))
    assert sent == [("cleanup_failed_cluster", (cluster.pk,))]
    tasks.cleanup_failed_cluster(cluster.pk)
    assert _claimed_by(k8s, reservation.pk) == set()
    assert f"tenant-alpha-r{reservation.pk}" not in k8s.namespaces
    sent.clear()
    services.lifecycle_tick(now=timezone.now() + timedelta(minutes=20))
    assert sent == []  # done: nothing more to send
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.FAILED  # still failed, for staff to retry

    # Another tenant booked on that node gets a cluster on it.
    Node.objects.exclude(hostname=host).update(state=NodeState.MAINTENANCE)
    other = book(world, "beta-lead", t0, hours=2, nodes=1, orchestrator="kubernetes")
    assert _held(other) == {host}
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    assert services.cluster_provision(cluster_id=VirtualCluster.objects.get(reservation=other).pk) == "ready"
