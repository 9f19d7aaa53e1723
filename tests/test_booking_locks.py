"""What a booking locks, and what it does when PostgreSQL reports a collision mid-transaction."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

from reservations.models import Allocation, Reservation
from reservations.services import reservation_create
from tenants.models import Membership

from .conftest import make_world
from .racing import failing_inserts, in_thread, lock_waiters, pausing_inserts, until


@pytest.mark.django_db(transaction=True)
def test_bookings_of_two_tenants_in_one_pool_do_not_wait_for_each_other(t0):
    """Alpha's booking holds its quota row mid-transaction; beta's booking in the same pool completes meanwhile.

    Quota's default ordering joins tenant and pool: a lock that followed the join would hold the
    pool row, so beta would wait for alpha's commit (here: forever, alpha waits for beta).
    """
    world = make_world(nodes=4, max_nodes=2, burst_nodes=0)
    results: dict[str, object] = {}

    def book(who: str):
        return in_thread(results, who, lambda: reservation_create(
            actor=world.users[f"{who}-lead"], tenant=world.tenants[who], pool=world.pool, node_count=1, start=t0,
            end=t0 + timedelta(hours=2)))

    # Alpha's booking takes its quota row, then waits in its next statement: the rights read share-locks the
    # booker's membership row, held here FOR UPDATE. Mid-transaction, its quota row locked, before it has picked
    # (and locked) any node, so beta cannot meet it on a node either.
    membership = Membership.objects.get(user=world.users["alpha-lead"], tenant=world.tenants["alpha"])
    with transaction.atomic():
        Membership.objects.select_for_update().get(pk=membership.pk)
        alpha = book("alpha")
        until(lambda: not alpha.is_alive() or lock_waiters() >= 1)
        assert alpha.is_alive(), results  # waiting on the membership row, holding its quota row
        beta = book("beta")
        # Until beta finishes or is seen queued on a lock besides alpha: a fixed 15 s join failed a correct
        # booking that a loaded machine ran slower than that.
        deadline = time.monotonic() + 120
        while beta.is_alive() and lock_waiters() < 2 and time.monotonic() < deadline:
            beta.join(0.02)
        finished_while_alpha_held_its_lock = not beta.is_alive()
        assert alpha.is_alive()  # still waiting
    alpha.join(30)
    beta.join(30)
    assert finished_while_alpha_held_its_lock, "beta's booking waited for alpha's transaction"
    assert isinstance(results["alpha"], Reservation) and isinstance(results["beta"], Reservation)
    assert Allocation.objects.filter(active=True).count() == 2


@pytest.mark.django_db
def test_a_deadlock_reported_mid_booking_is_retried(t0):
    """PostgreSQL aborts the booking with SQLSTATE 40P01 once: the whole transaction is tried again."""
    world = make_world(nodes=4, max_nodes=2, burst_nodes=0)
    with failing_inserts("reservations_reservation", sqlstate="40P01", message="deadlock detected") as tried:
        reservation = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                         pool=world.pool, node_count=2, start=t0, end=t0 + timedelta(hours=1))
        assert tried() == 2
    assert reservation.allocations.filter(active=True).count() == 2
    assert Reservation.objects.count() == 1


@pytest.mark.django_db
def test_other_operational_errors_are_not_retried(t0):
    from django.db import OperationalError

    world = make_world(nodes=4, max_nodes=2, burst_nodes=0)
    # 57014: query_canceled (e.g. statement_timeout)
    with failing_inserts("reservations_reservation", sqlstate="57014", message="canceling statement") as tried:
        with pytest.raises(OperationalError):
            reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                               pool=world.pool, node_count=1, start=t0, end=t0 + timedelta(hours=1))
        assert tried() == 1
    assert Reservation.objects.count() == 0


def test_the_node_lock_namespace_is_the_registered_one():
    """The booking statement hard-codes its advisory-lock namespace; the registry must agree."""
    from provisioning.constants import LOCK_BOOKING_NODE, LOCK_SLOT_USAGE_NODE
    from reservations import services

    assert f"pg_advisory_xact_lock({LOCK_BOOKING_NODE}," in services._NODE_LOCKS
    assert LOCK_BOOKING_NODE != LOCK_SLOT_USAGE_NODE
    # The writes run after the locks (their own statement) and only for nodes still available then
    # (tests/health_flow/test_drain_race.py races a drain against a booking).
    assert services._READY in services._INSERT_BOOKING_SQL and services._READY in services._ALLOCATE_SQL


@pytest.mark.django_db(transaction=True)
def test_a_maintenance_window_racing_a_booking_of_its_node_is_refused_cleanly(t0):
    """Staff block a node while a booking of it is between its insert and its commit: the window
    waits for the booking (node lock), then is refused as booked — a 409, never a deadlock or 500."""
    from portal.core.exceptions import CapacityUnavailable
    from reservations import services
    from reservations.models import Node

    world = make_world(nodes=1, max_nodes=1, burst_nodes=0)
    node = Node.objects.get()
    outcome: dict = {}

    def book():
        try:
            outcome["booking"] = reservation_create(
                actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=node.pool, node_count=1,
                start=t0, end=t0 + timedelta(hours=2))
        except Exception as exc:  # noqa: BLE001 - asserted on below
            outcome["booking"] = exc
        finally:
            connection.close()

    def staff():
        try:
            outcome["maintenance"] = services.maintenance_window_create(
                actor=world.users["staff"], node=node, start=t0, end=t0 + timedelta(hours=2))
        except Exception as exc:  # noqa: BLE001 - asserted on below
            outcome["maintenance"] = exc
        finally:
            connection.close()

    with pausing_inserts("reservations_reservation") as pause:  # the booking, between its insert and its commit
        booking = threading.Thread(target=book)
        booking.start()
        pause.wait_reached()
        window = threading.Thread(target=staff)
        window.start()
        # Until the window is seen queued behind the booking (or has come back without waiting).
        deadline = time.monotonic() + 60
        while window.is_alive() and lock_waiters() < 2 and time.monotonic() < deadline:
            window.join(0.02)
        pause.release()
        booking.join(30)
        window.join(30)
    booked = outcome["booking"]
    assert isinstance(booked, Reservation) and booked.node_count == 1, outcome
    assert isinstance(outcome["maintenance"], CapacityUnavailable), outcome
    assert Allocation.objects.filter(active=True).count() == 1
