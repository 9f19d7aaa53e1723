"""The fleet's rules where pools and nodes meet bookings: slot-length changes, node states, repairs."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection

from portal.core.exceptions import InvalidInput, InvalidState
from reservations import selectors, services
from reservations.models import Reservation
from reservations.services import pool_update, reservation_create
from reservations.timeutil import is_aligned

from .conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)


def _someone_waits_for_me() -> bool:
    with connection.cursor() as cur:
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
    chosen, updated = threading.Event(), threading.Event()
    real_free_nodes = selectors.free_nodes

    def free_nodes_then_wait(**kwargs):
        nodes = real_free_nodes(**kwargs)
        chosen.set()
        # The slot change runs now: unfixed it commits here; fixed it queues behind this booking.
        _wait_for(updated)
        return nodes

    def book():
        with mock.patch.object(selectors, "free_nodes", side_effect=free_nodes_then_wait):
            return reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=pool,
                                      node_count=1, start=start, end=start + timedelta(hours=1))

    def change_slot():
        chosen.wait(10)
        try:
            return pool_update(actor=world.users["staff"], pool=pool, slot_minutes=60)
        finally:
            updated.set()

    booked, changed = _in_threads(book, change_slot)
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
