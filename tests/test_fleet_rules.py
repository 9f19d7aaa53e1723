"""The fleet's rules where pools and nodes meet bookings: slot-length changes, node states, repairs."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection, transaction

from portal.core.exceptions import InvalidInput, InvalidState
from provisioning.constants import LOCK_BOOKING_NODE
from reservations import services
from reservations.choices import AllocationKind
from reservations.models import Allocation, Node, Reservation
from reservations.services import pool_update, reservation_create
from reservations.timeutil import is_aligned

from .conftest import make_world
from .racing import in_thread, lock_waiters, until

pytestmark = pytest.mark.django_db(transaction=True)


def _someone_waits_for_me() -> bool:
    with connection.cursor() as cur:
        # Inside a transaction PostgreSQL answers pg_stat_activity from the snapshot of its first read: without
        # this, a waiter that queued after the first poll is never seen.
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")
        return bool(cur.fetchone()[0])


def _wait_for(event: threading.Event, *, timeout: float = 10) -> None:
    """Wait until event is set or another session queues on a lock this thread's transaction holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if event.wait(0.02) or _someone_waits_for_me():
            return
    raise AssertionError("the other side neither finished nor queued on a lock of ours")


def _in_threads(*fns) -> list:
    results: list = [None] * len(fns)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # asserted on by the caller
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, fn), name=f"t{i}") for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


def _off_grid_bookings(pool) -> list[int]:
    pool.refresh_from_db()
    return [r.pk for r in Reservation.objects.filter(pool=pool)
            if not (is_aligned(r.period.lower, pool.slot_minutes) and is_aligned(r.period.upper, pool.slot_minutes))]


# --- a slot-length change racing a booking ----------------------------------------------------------------


@pytest.fixture
def half_hour_world(db):
    world = make_world()
    world.pool.slot_minutes = 30
    world.pool.save()
    return world


def test_a_booking_that_chose_its_nodes_holds_off_a_slot_length_change(half_hour_world, t0):
    world = half_hour_world
    pool = world.pool  # read once, as the API's serializer reads it: slot 30
    start = t0 + timedelta(minutes=30)  # on the 30-minute grid, off the 60-minute one
    result: dict = {}

    def book():
        return reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=pool,
                                  node_count=1, start=start, end=start + timedelta(hours=1))

    def change_slot():
        return pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)

    # The booking has judged its quota and chosen its nodes, and waits to lock them: every node's booking lock
    # (services._NODE_LOCKS) is held here. The slot change runs meanwhile: unfixed it commits now; fixed it queues
    # behind the booking.
    keys = [(LOCK_BOOKING_NODE, node.pk) for node in world.nodes]
    with connection.cursor() as cur:
        for key in keys:
            cur.execute("SELECT pg_advisory_lock(%s, %s)", key)
    booking = in_thread(result, "booked", book)
    until(lambda: not booking.is_alive() or lock_waiters() >= 1)
    changing = in_thread(result, "changed", change_slot)
    until(lambda: not changing.is_alive() or lock_waiters() >= 2)
    with connection.cursor() as cur:
        for key in keys:
            cur.execute("SELECT pg_advisory_unlock(%s, %s)", key)
    booking.join(30)
    changing.join(30)
    booked, changed = result["booked"], result["changed"]
    # was: both succeeded: the change saw no open booking (it had not committed yet) and the booking,
    # validated against the old 30-minute grid, committed 10:30-11:30 into a 60-minute pool
    assert isinstance(booked, Reservation), booked
    assert isinstance(changed, InvalidState), changed
    assert _off_grid_bookings(pool) == []


def test_a_booking_waits_for_a_slot_length_change_and_is_judged_on_the_new_grid(half_hour_world, t0):
    world = half_hour_world
    pool = world.pool  # slot 30, read before the change
    start = t0 + timedelta(minutes=30)
    changing, booking_done = threading.Event(), threading.Event()
    real_audit = services.audit_record

    def audit_then_wait(**kwargs):
        real_audit(**kwargs)
        if kwargs.get("action") == "pool.update":  # the change holds the pool row until it commits
            changing.set()
            _wait_for(booking_done)

    def change_slot():
        return pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)

    def book():
        changing.wait(10)
        try:
            return reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=pool,
                                      node_count=1, start=start, end=start + timedelta(hours=1))
        finally:
            booking_done.set()

    with mock.patch.object(services, "audit_record", side_effect=audit_then_wait):
        changed, booked = _in_threads(change_slot, book)
    assert not isinstance(changed, BaseException), changed
    # was: the booking waited for the change's lock inside its insert, then wrote the off-grid window anyway
    assert isinstance(booked, InvalidInput), booked
    assert "60-minute slot grid" in booked.detail
    assert _off_grid_bookings(pool) == []
    assert Reservation.objects.count() == 0



# --- a slot-length change and maintenance windows ---------------------------------------------------------


def _off_grid_windows(pool) -> list[int]:
    pool.refresh_from_db()
    return [a.pk for a in Allocation.objects.filter(node__pool=pool, kind=AllocationKind.MAINTENANCE, active=True)
            if not (is_aligned(a.period.lower, pool.slot_minutes) and is_aligned(a.period.upper, pool.slot_minutes))]


def test_a_slot_length_change_is_refused_while_a_maintenance_window_is_off_the_new_grid(half_hour_world, t0):
    # was: the change went through with the window left on 10:30-11:30 in a 60-minute pool, blocking half-slots
    world = half_hour_world
    pool, node = world.pool, world.nodes[0]
    start = t0 + timedelta(minutes=30)
    window = services.maintenance_window_create(actor=world.users["staff"], node=node, start=start,
                                                end=start + timedelta(hours=1))
    with pytest.raises(InvalidState) as refused:
        pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)
    assert node.hostname in refused.value.detail and "maintenance" in refused.value.detail
    pool.refresh_from_db()
    assert pool.slot_minutes == 30
    # A window withdrawn (inactive) no longer holds it off; one on the new grid never did.
    services.maintenance_windows_end(actor=world.users["staff"], nodes=[node])
    window.refresh_from_db()
    assert not window.active
    services.maintenance_window_create(actor=world.users["staff"], node=world.nodes[1], start=t0,
                                       end=t0 + timedelta(hours=2))
    pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)
    pool.refresh_from_db()
    assert pool.slot_minutes == 60 and _off_grid_windows(pool) == []


def test_a_maintenance_window_being_scheduled_holds_off_a_slot_length_change(half_hour_world, t0):
    world = half_hour_world
    pool, node = world.pool, world.nodes[0]
    start = t0 + timedelta(minutes=30)  # on the 30-minute grid, off the 60-minute one
    scheduled, updated = threading.Event(), threading.Event()
    real_audit = services.audit_record

    def audit_then_wait(**kwargs):
        real_audit(**kwargs)
        if kwargs.get("action") == "node.maintenance":  # the window is written, not committed yet
            scheduled.set()
            _wait_for(updated)

    def schedule():
        return services.maintenance_window_create(actor=world.users["staff"], node=node, start=start,
                                                  end=start + timedelta(hours=1))

    def change_slot():
        scheduled.wait(10)
        try:
            return pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)
        finally:
            updated.set()

    with mock.patch.object(services, "audit_record", side_effect=audit_then_wait):
        window, changed = _in_threads(schedule, change_slot)
    assert isinstance(window, Allocation), window
    # unguarded: the change saw no window (not committed yet) and the pool went to 60 minutes under it
    assert isinstance(changed, InvalidState), changed
    assert _off_grid_windows(pool) == []


def test_a_maintenance_window_waits_for_a_slot_length_change_and_is_judged_on_the_new_grid(half_hour_world, t0):
    world = half_hour_world
    node = world.nodes[0]  # its pool read before the change: slot 30
    pool = world.pool
    start = t0 + timedelta(minutes=30)
    changing, scheduling_done = threading.Event(), threading.Event()
    real_audit = services.audit_record

    def audit_then_wait(**kwargs):
        real_audit(**kwargs)
        if kwargs.get("action") == "pool.update":  # the change holds the pool row until it commits
            changing.set()
            _wait_for(scheduling_done)

    def change_slot():
        return pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)

    def schedule():
        changing.wait(10)
        try:
            return services.maintenance_window_create(actor=world.users["staff"], node=node, start=start,
                                                      end=start + timedelta(hours=1))
        finally:
            scheduling_done.set()

    with mock.patch.object(services, "audit_record", side_effect=audit_then_wait):
        changed, window = _in_threads(change_slot, schedule)
    assert not isinstance(changed, BaseException), changed
    # unguarded: the window, checked on the 30-minute grid it had read, was written into the 60-minute pool
    assert isinstance(window, InvalidInput), window
    assert "60-minute slot grid" in window.detail
    assert _off_grid_windows(pool) == []

# --- a node an open repair owns returns through its repair, not through node_update -------------------


def test_the_api_refuses_to_return_a_node_an_open_repair_owns(db, t0):
    from provisioning.health.services import repair_open, repairs_reconcile

    world = make_world()
    node = world.nodes[0]
    repair = repair_open(actor=world.users["staff"], node=node, reason="ECC errors")
    staff = world.client("staff")

    r = staff.patch(f"/api/v1/nodes/{node.pk}/", {"state": "available"}, format="json")
    # was: 200 and the node took bookings until the health upkeep drained it again and moved them off
    assert r.status_code == 409, r.content
    assert r.json()["code"] == "invalid_state"
    assert f"repair #{repair.pk}" in r.json()["detail"] and node.hostname in r.json()["detail"]
    node.refresh_from_db()
    assert node.state == "draining"
    assert repairs_reconcile() == 0  # nothing for the upkeep to undo

    # The rest of the node stays editable, and the service says the same as the API.
    r = staff.patch(f"/api/v1/nodes/{node.pk}/", {"state_reason": "waiting for the vendor"}, format="json")
    assert r.status_code == 200 and r.json()["state"] == "draining"
    with pytest.raises(InvalidState, match=f"repair #{repair.pk}"):
        services.node_update(actor=world.users["staff"], node=node, state="available")
    # A node without an open repair returns as before.
    other = world.nodes[1]
    services.node_update(actor=world.users["staff"], node=other, state="draining")
    assert staff.patch(f"/api/v1/nodes/{other.pk}/", {"state": "available"}, format="json").status_code == 200


def test_a_no_op_update_of_an_available_node_does_not_queue_behind_a_health_step(db):
    """Only a node coming back from another state asks the return blockers (which take the health lock)."""
    from provisioning.health.services import _node_lock

    world = make_world()
    staff, node = world.users["staff"], world.nodes[0]
    health_holds, updated = threading.Event(), threading.Event()
    update_finished_first: list[bool] = []

    def health_step_in_flight():
        with _node_lock(node.pk):
            health_holds.set()
            _wait_for(updated)  # the no-op either finishes, or queues on our lock
            update_finished_first.append(updated.is_set())

    def no_op_update():
        health_holds.wait(10)
        try:
            return services.node_update(actor=staff, node=node, state="available", reason="checked")
        finally:
            updated.set()

    held, done = _in_threads(health_step_in_flight, no_op_update)
    assert not isinstance(held, BaseException), held
    assert not isinstance(done, BaseException), done
    # was: [False]: the blockers were asked first, so the no-op queued on the health step's lock
    assert update_finished_first == [True]
    assert done.state == "available" and done.state_reason == "checked"


def test_a_node_drained_with_a_repair_while_it_was_being_made_available_is_not_returned(db):
    """The no-op shortcut reads the node before its locks: one that left available meanwhile still meets the
    blockers (a health step drains and opens a repair under the health lock and the node's booking lock)."""
    from provisioning.health.models import Repair
    from provisioning.health.services import _node_lock

    world = make_world()
    staff, node = world.users["staff"], world.nodes[0]
    drained, updated = threading.Event(), threading.Event()

    def health_step_drains_and_opens_a_repair():
        with _node_lock(node.pk), transaction.atomic():
            services._lock_nodes([node.pk])
            Node.objects.filter(pk=node.pk).update(state="draining", state_reason="check failed")
            Repair.objects.create(node_id=node.pk, reason="check failed")
            drained.set()
            _wait_for(updated)  # the update queues on one of our locks (it read the node as available)

    def make_available():
        drained.wait(10)
        try:
            return services.node_update(actor=staff, node=node, state="available")
        finally:
            updated.set()

    health, outcome = _in_threads(health_step_drains_and_opens_a_repair, make_available)
    assert not isinstance(health, BaseException), health
    assert isinstance(outcome, InvalidState), outcome
    assert "repair #" in str(outcome)
    node.refresh_from_db()
    assert node.state == "draining"


def test_a_repair_that_rejoins_its_node_still_makes_it_available(db):
    from provisioning.health.models import HealthCheck
    from provisioning.health.services import repair_advance, repair_open

    world = make_world()
    staff, node = world.users["staff"], world.nodes[0]
    repair = repair_open(actor=staff, node=node, reason="manual")
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    HealthCheck.objects.filter(pk=repair.retest_check_id).update(status="done", verdict="pass")
    repair_advance(actor=staff, repair=repair, to="rejoined")
    node.refresh_from_db()
    assert node.state == "available"


# --- the health step's node lock and the availability summary's node lock ----------------------------------


def test_a_health_step_and_a_booking_moved_onto_its_node_do_not_deadlock(db):
    """A health step holds its node lock (session) while it drains the node; a booking being moved onto that
    node as a spare (cut at now: off the slot grid) holds the node's booking lock and, in the availability
    summary's trigger, takes the off-grid lock of the node. Both were pg_advisory (72001, node id)."""
    from provisioning.health.services import _node_lock

    from .conftest import now_clear_of_the_hour

    world = make_world()
    staff = world.users["staff"]
    now = now_clear_of_the_hour(120)
    start = now.replace(minute=0, second=0, microsecond=0)
    booked = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                                node_count=1, start=start, end=start + timedelta(hours=2))
    failing = booked.allocations.get().node
    spare, *others = [n for n in world.nodes if n.pk != failing.pk]
    for node in others:
        services.node_update(actor=staff, node=node, state="maintenance")
    services.node_update(actor=staff, node=failing, state="failed")
    health_holds, moved = threading.Event(), threading.Event()
    move_finished_first: list[bool] = []

    def health_step_on_the_spare():
        with _node_lock(spare.pk):
            health_holds.set()
            _wait_for(moved)  # the move either finishes, or queues on our lock
            move_finished_first.append(moved.is_set())
            return services.node_update(actor=None, node=spare, state="draining", reason="check failed")

    def move_the_booking():
        health_holds.wait(10)
        try:
            return services.node_replace_allocations(node=failing, reason="GPU fell off the bus")
        finally:
            moved.set()

    drained, outcomes = _in_threads(health_step_on_the_spare, move_the_booking)
    assert not isinstance(drained, BaseException), drained
    assert not isinstance(outcomes, BaseException), outcomes
    # was: the move queued on the health step's lock inside its insert, holding the spare's booking lock;
    # the drain then queued on that: a deadlock PostgreSQL broke after a second (40P01), the move retried,
    # found the spare drained and degraded the booking
    assert move_finished_first == [True]
    assert [o["result"] for o in outcomes] == ["replaced"]


def test_the_advisory_lock_namespaces_are_distinct():
    from portal.core import locks
    from provisioning import constants
    from provisioning.health import services as health

    keys = {name: value for module in (locks, constants) for name, value in vars(module).items()
            if name.startswith("LOCK_") and isinstance(value, int)}
    assert len(set(keys.values())) == len(keys), keys
    # was: the health step's lock was its own 72001, the off-grid summary lock's namespace (not registered)
    assert keys.get("LOCK_NODE_HEALTH") == health.LOCK_NODE_HEALTH


# --- retired nodes ----------------------------------------------------------------------------------------


def test_asking_for_more_nodes_than_a_pool_has_counts_only_the_nodes_not_retired(db, t0):
    world = make_world()
    services.node_update(actor=world.users["staff"], node=world.nodes[0], state="retired")
    with pytest.raises(InvalidInput) as refused:
        reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                           node_count=4, start=t0, end=t0 + timedelta(hours=1))
    # was: "The h100 pool has only 4 nodes." when asking for 4: the check left the retired node out, the text not
    assert refused.value.fields == {"node_count": "The h100 pool has only 3 nodes."}
