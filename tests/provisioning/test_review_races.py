"""Interleavings of provisioning, teardown, staff retry and node swaps on the real database (found in a
review of the background side; each test failed on the code before its fix)."""

import threading
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection

from portal.core import events
from portal.core.locks import advisory_lock
from provisioning import services
from provisioning.backends.base import BackendError
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.choices import ReservationStatus
from reservations.models import Allocation, Node
from reservations.services import node_update, reservation_cancel
from tests.provisioning.conftest import book, now_slot

pytestmark = pytest.mark.django_db


@contextmanager
def held_elsewhere(namespace: int, key: int):
    """Hold an advisory lock from another thread (another worker's connection) for the block."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        try:
            with advisory_lock(namespace, key) as held:
                assert held
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    worker = threading.Thread(target=hold)
    worker.start()
    assert holding.wait(10)
    try:
        yield
    finally:
        release.set()
        worker.join(30)


@pytest.fixture
def captured():
    seen = []

    def record(event, payload):
        seen.append((event, payload))

    events.subscribe("*", record)
    yield seen
    events.unsubscribe("*", record)


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


@pytest.mark.django_db(transaction=True)
def test_a_node_swap_never_rebuilds_a_cluster_torn_down_meanwhile(world, monkeypatch):
    """The swap (a worker) and the teardown (another worker) of one cluster never overlap: the teardown
    that starts while the swap is in the backend finds the cluster busy, and runs after it."""
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=4, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    assert services.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    real_build = services.build_context
    seen = {}

    def teardown_in_other_worker(cluster_id):
        try:
            seen["teardown"] = services.cluster_teardown(cluster_id=cluster_id)
        finally:
            connection.close()

    def build_while_the_tenant_cancels(cluster_id):
        ctx = real_build(cluster_id)
        if not seen:  # the swap has read READY and built its context; the tenant cancels now
            reservation_cancel(actor=world.users["alpha-lead"], reservation=reservation)
            worker = threading.Thread(target=teardown_in_other_worker, args=(cluster_id,))
            worker.start()
            worker.join(30)
        return ctx

    monkeypatch.setattr(services, "build_context", build_while_the_tenant_cancels)
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed="h100-001", spare="h100-004") \
        == "replaced"
    monkeypatch.setattr(services, "build_context", real_build)
    assert seen["teardown"] == "busy"  # its task asks again a few seconds later
    assert services.cluster_teardown(cluster_id=cluster.pk) == ClusterStatus.DELETED
    cluster.refresh_from_db()
    reservation.refresh_from_db()
    assert cluster.status == ClusterStatus.DELETED and reservation.status == ReservationStatus.CANCELLED
    # The cancelled reservation keeps no cluster in the backend.
    assert not SimulatedBackend().status(services.build_context(cluster.pk)).exists


@pytest.mark.django_db(transaction=True)
def test_a_node_swap_waits_for_a_running_provisioning_then_asks_again(world, monkeypatch):


    from provisioning.constants import LOCK_CLUSTER

    reservation = book(world, "alpha-lead", now_slot(world), hours=4, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    monkeypatch.setattr(services, "LOCK_WAIT_S", 0.3)
    with held_elsewhere(LOCK_CLUSTER, cluster.pk):  # provisioning elsewhere
        with pytest.raises(services.RetryLater):
            services.cluster_nodes_changed(reservation_id=reservation.pk, failed="h100-001", spare="h100-004")
    assert services.cluster_nodes_changed(reservation_id=reservation.pk, failed="h100-001", spare="h100-004") \
        in ("replaced", "degraded")

def test_a_backend_error_after_a_teardown_request_leaves_the_teardown_in_charge(world, monkeypatch, captured):
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)

    def install_drivers(self, ctx):
        # While the driver install runs, the lead presses "tear down" (row lock only, no advisory lock).
        services.cluster_request_teardown(actor=world.users["alpha-lead"], cluster=VirtualCluster.objects.get(
            pk=ctx.cluster_id))
        raise BackendError("driver image missing", transient=False)

    monkeypatch.setattr(SimulatedBackend, "install_drivers", install_drivers)
    captured.clear()
    services.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    phases = list(cluster.transitions.order_by("at", "id").values_list("phase", flat=True))
    # tearing_down must not go back to failed, nor may the tenant be told its cluster "failed".
    assert cluster.status == ClusterStatus.TEARING_DOWN, phases
    assert not [e for e, _ in captured if e == "cluster.failed"], phases


def test_teardown_gets_its_own_attempts_after_provisioning_spent_some(
        world, t0, settings, monkeypatch):
    import time as _time
    settings.PORTAL_PROVISIONING_FAULTS = "installing_drivers=error"
    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    cluster = VirtualCluster.objects.get(reservation=reservation)
    for _ in range(2):  # two transient failures (max 3 attempts in the fast settings)
        with pytest.raises(services.RetryLater) as exc:
            services.cluster_provision(cluster_id=cluster.pk)
        _time.sleep(exc.value.countdown + 0.05)
    settings.PORTAL_PROVISIONING_FAULTS = ""
    reservation_cancel(actor=world.users["alpha-lead"], reservation=reservation)

    def flaky_teardown(self, ctx):
        raise BackendError("API server timeout")  # transient

    monkeypatch.setattr(SimulatedBackend, "teardown", flaky_teardown)
    try:
        services.cluster_teardown(cluster_id=cluster.pk)
    except services.RetryLater:
        pass  # what a first transient teardown error should give
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.TEARING_DOWN, (cluster.status, cluster.failed_during, cluster.attempts)


def gate_checks_still_running(*, cluster):
    raise services.RetryLater(300.0, "health checks running on 1 of 1 nodes")


def test_the_tick_leaves_a_cluster_waiting_on_its_gate_to_its_own_retry(world, settings, monkeypatch):
    """The acceptance gate asks to be asked again later: the tick must not start a second provisioning chain
    while the first one's retry is pending (each chain retries itself), only once that retry is overdue."""
    from django.utils import timezone

    settings.PORTAL_ACCEPTANCE_GATE = "tests.provisioning.test_review_races.gate_checks_still_running"
    sent = []
    monkeypatch.setattr(services, "_send", lambda name, *args, countdown=None: sent.append((name, args)))
    reservation = book(world, "alpha-lead", now_slot(world), hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    with pytest.raises(services.RetryLater):
        services.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.RUNNING_ACCEPTANCE_TESTS and cluster.next_attempt_at is not None
    sent.clear()
    now = timezone.now()
    services.lifecycle_tick(now=now + timedelta(seconds=200))  # dispatched long ago, but its retry is due at +300 s
    assert [s for s in sent if s[0] == "provision_cluster"] == []
    assert services.cluster_provision(cluster_id=cluster.pk) == "waiting"  # an early duplicate ends at once
    services.lifecycle_tick(now=now + timedelta(seconds=400))  # the retry never came: its message was lost
    assert [s[0] for s in sent if s[0] == "provision_cluster"] == ["provision_cluster"]


@pytest.mark.django_db(transaction=True)
def test_two_syncs_of_one_node_never_overlap(world, monkeypatch):
    """node_sync reads the node's state and drives the backends under the node's lock: a second sync (the
    node came back meanwhile) waits for the first and then acts on the latest state."""


    from provisioning.constants import LOCK_NODE_SYNC

    node = world.nodes[0]
    monkeypatch.setattr(services, "LOCK_WAIT_S", 0.3)
    with held_elsewhere(LOCK_NODE_SYNC, node.pk):  # first sync elsewhere
        with pytest.raises(services.RetryLater):
            services.node_sync(node_id=node.pk)
    assert services.node_sync(node_id=node.pk) == {}  # available: resumed, nothing to move


def test_a_window_change_reaches_the_backend_through_the_outbox(world, t0, settings, monkeypatch,
                                                                django_capture_on_commit_callbacks):
    """reservation.changed is a background subscriber: its outbox row commits with the change, so a sync whose
    message was lost after the commit is sent again by the relay (not left for `manage.py reconcile`)."""
    from portal.core.models import OutboxEvent
    from reservations.services import reservation_update

    reservation = book(world, "alpha-lead", t0)
    services.lifecycle_tick(now=t0 - timedelta(minutes=10))
    settings.PORTAL_EVENTS_INLINE = False  # as in production
    reservation_update(actor=world.users["alpha-lead"], reservation=reservation,
                       end=reservation.end + timedelta(hours=1))
    row = OutboxEvent.objects.get(event="reservation.changed", payload__reservation_id=reservation.pk)
    from provisioning.handlers import on_reservation_changed
    assert on_reservation_changed in events._handlers(events._background, "reservation.changed")
    assert on_reservation_changed not in events._handlers(events._subscribers, "reservation.changed")
    synced = []
    monkeypatch.setattr(services, "reservation_sync", lambda *, reservation_id: synced.append(reservation_id))
    with django_capture_on_commit_callbacks(execute=True):
        assert events.outbox_dispatch(row.pk) == "done"  # the worker's side: the sync runs there
    assert synced == [reservation.pk]


@pytest.mark.django_db(transaction=True)
def test_a_booking_sync_waits_while_the_cluster_is_provisioned_or_torn_down(world, monkeypatch):
    """reservation_sync holds the cluster's lock too: it can no longer book again in the backend what a
    teardown running beside it has just released."""


    from provisioning.constants import LOCK_CLUSTER

    reservation = book(world, "alpha-lead", now_slot(world), hours=4, nodes=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    monkeypatch.setattr(services, "LOCK_WAIT_S", 0.3)
    with held_elsewhere(LOCK_CLUSTER, cluster.pk):  # teardown elsewhere
        with pytest.raises(services.RetryLater, match="cluster busy"):
            services.reservation_sync(reservation_id=reservation.pk)
    assert services.reservation_sync(reservation_id=reservation.pk) in ("nothing to sync", "booked", "updated")


def _retries_while_the_cluster_is_held(task, cluster_id: int) -> tuple[object, list[float]]:
    """Run task eagerly while another session holds the cluster's lock: each retry runs at once (the lock is
    still held) until the bound is reached. Return its result and the countdowns its retries asked for."""
    from celery.signals import task_retry

    from provisioning.constants import LOCK_CLUSTER

    countdowns = []

    def on_retry(request=None, reason=None, **kwargs):
        countdowns.append(reason.when)

    task_retry.connect(on_retry, weak=False)
    try:
        with held_elsewhere(LOCK_CLUSTER, cluster_id):
            result = task.apply(args=[cluster_id]).get()
    finally:
        task_retry.disconnect(on_retry)
    return result, countdowns


@pytest.mark.django_db(transaction=True)
def test_a_busy_provisioning_task_retries_a_few_times_then_leaves_it_to_the_tick(world):
    """A provisioning task that finds the cluster's lock taken (a sync, a swap, or a duplicate delivery while
    the run itself goes on) asks again a few seconds later, a bounded number of times: duplicate deliveries
    never each start an endless chain (the tick's resend stays the backstop)."""
    from provisioning import tasks

    reservation = book(world, "alpha-lead", now_slot(world), hours=4)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    result, countdowns = _retries_while_the_cluster_is_held(tasks.provision_cluster, cluster.pk)
    assert result == "busy"
    assert countdowns and len(countdowns) == tasks._PROVISION_BUSY_RETRIES
    assert all(0 < c <= 10 for c in countdowns)  # soon, not PORTAL_PROVISIONING_REDISPATCH_SECONDS later
    assert tasks.provision_cluster.apply(args=[cluster.pk]).get() == ClusterStatus.READY


@pytest.mark.django_db(transaction=True)
def test_a_busy_failed_cluster_cleanup_asks_again_soon_by_itself(world, t0, settings):
    """cleanup_failed_cluster gave up on 'busy' (a sync or swap held the cluster) and left the failed cluster's
    backend objects (and the nodes' claim) to the tick's resend, minutes later. It now retries itself after a
    few seconds, a bounded number of times, and a retry after the lock is let go cleans up."""
    from provisioning import tasks

    reservation, cluster = _failed_booking(world, t0, settings)
    VirtualCluster.objects.filter(pk=cluster.pk).update(backend_state={"cleanup_pending": True})
    result, countdowns = _retries_while_the_cluster_is_held(tasks.cleanup_failed_cluster, cluster.pk)
    assert result == "busy"
    assert countdowns and len(countdowns) == tasks._CLEANUP_BUSY_RETRIES
    assert all(0 < c <= 10 for c in countdowns)  # soon, not PORTAL_PROVISIONING_REDISPATCH_SECONDS later
    assert tasks.cleanup_failed_cluster.apply(args=[cluster.pk]).get() == "cleaned up"
    assert "cleanup_pending" not in VirtualCluster.objects.get(pk=cluster.pk).backend_state
    # Safe to run twice: a late copy finds the cleanup done and changes nothing.
    assert tasks.cleanup_failed_cluster.apply(args=[cluster.pk]).get() == "cleaned up"
