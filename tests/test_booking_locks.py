"""What a booking locks, and what it does when PostgreSQL reports a collision mid-transaction."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection

from reservations import selectors
from reservations.models import Allocation, Reservation
from reservations.services import reservation_create

from .conftest import make_world
from .racing import lock_waiters


@pytest.mark.django_db(transaction=True)
def test_bookings_of_two_tenants_in_one_pool_do_not_wait_for_each_other(monkeypatch, t0):
    """Alpha's booking holds its quota row mid-transaction; beta's booking in the same pool completes meanwhile.

    Quota's default ordering joins tenant and pool: a lock that followed the join would hold the
    pool row, so beta would wait for alpha's commit (here: forever, alpha waits for beta).
    """
    world = make_world(nodes=4, max_nodes=2, burst_nodes=0)
    alpha_holds_quota = threading.Event()
    beta_done = threading.Event()
    real_free_nodes = selectors.free_nodes

    def free_nodes(**kwargs):  # the booking's next step after its quota lock and peak
        if threading.current_thread().name == "alpha":
            alpha_holds_quota.set()
            beta_done.wait(30)  # keep the transaction open, quota row locked, until beta is through
        return real_free_nodes(**kwargs)

    monkeypatch.setattr(selectors, "free_nodes", free_nodes)
    results: dict[str, object] = {}

    def book(who: str) -> None:
        try:
            results[who] = reservation_create(actor=world.users[f"{who}-lead"], tenant=world.tenants[who],
                                              pool=world.pool, node_count=1, start=t0, end=t0 + timedelta(hours=2))
        except BaseException as exc:  # asserted below
            results[who] = exc
        finally:
            connection.close()

    alpha = threading.Thread(target=book, args=("alpha",), name="alpha")
    alpha.start()
    assert alpha_holds_quota.wait(30)
    beta = threading.Thread(target=book, args=("beta",), name="beta")
    beta.start()
    # Until beta finishes or is seen queued on a lock: a fixed 15 s join failed a correct booking that a loaded
    # machine ran slower than that.
    deadline = time.monotonic() + 120
    while beta.is_alive() and lock_waiters() == 0 and time.monotonic() < deadline:
        beta.join(0.02)
    finished_while_alpha_held_its_lock = not beta.is_alive()
    beta_done.set()
    alpha.join(30)
    beta.join(30)
    assert finished_while_alpha_held_its_lock, "beta's booking waited for alpha's transaction"
    assert isinstance(results["alpha"], Reservation) and isinstance(results["beta"], Reservation)
    assert Allocation.objects.filter(active=True).count() == 2


@pytest.mark.django_db
def test_a_deadlock_reported_mid_booking_is_retried(monkeypatch, t0):
    """PostgreSQL aborts the booking with SQLSTATE 40P01 once: the whole transaction is tried again."""
    world = make_world(nodes=4, max_nodes=2, burst_nodes=0)
    real_free_nodes = selectors.free_nodes
    calls = []

    def free_nodes(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # the server's own error, as a deadlock victim gets it
            with connection.cursor() as cur:
                cur.execute("DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END $$")
        return real_free_nodes(**kwargs)

    monkeypatch.setattr(selectors, "free_nodes", free_nodes)
    reservation = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                     pool=world.pool, node_count=2, start=t0, end=t0 + timedelta(hours=1))
    assert len(calls) == 2
    assert reservation.allocations.filter(active=True).count() == 2
    assert Reservation.objects.count() == 1


@pytest.mark.django_db
def test_other_operational_errors_are_not_retried(monkeypatch, t0):
    from django.db import OperationalError

    world = make_world(nodes=4, max_nodes=2, burst_nodes=0)
    calls = []

    def free_nodes(**kwargs):
        calls.append(kwargs)
        with connection.cursor() as cur:  # 57014: query_canceled (e.g. statement_timeout)
            cur.execute("DO $$ BEGIN RAISE EXCEPTION 'canceling statement' USING ERRCODE = '57014'; END $$")

    monkeypatch.setattr(selectors, "free_nodes", free_nodes)
    with pytest.raises(OperationalError):
        reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                           pool=world.pool, node_count=1, start=t0, end=t0 + timedelta(hours=1))
    assert len(calls) == 1
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
    import time
    from unittest import mock

    from portal.core.exceptions import CapacityUnavailable
    from reservations import services
    from reservations.models import Node

    world = make_world(nodes=1, max_nodes=1, burst_nodes=0)
    node = Node.objects.get()
    inserted, outcome = threading.Event(), {}
    original_audit = services.audit_record

    def audit_then_linger(**kwargs):  # inside the booking's transaction, after its insert
        original_audit(**kwargs)
        if kwargs["action"] == "reservation.create":
            inserted.set()
            # Until the window is seen queued behind this booking (or has come back without waiting): a fixed
            # 0.3 s let a slow staff thread arrive after the commit, and the race was never run.
            deadline = time.monotonic() + 60
            while "maintenance" not in outcome and time.monotonic() < deadline:
                with connection.cursor() as cur:
                    cur.execute("SELECT pg_stat_clear_snapshot()")  # a transaction keeps its first view of it
                if lock_waiters():
                    break
                time.sleep(0.02)

    def staff():
        try:
            assert inserted.wait(10)
            outcome["maintenance"] = services.maintenance_window_create(
                actor=world.users["staff"], node=node, start=t0, end=t0 + timedelta(hours=2))
        except Exception as exc:  # noqa: BLE001 - asserted on below
            outcome["maintenance"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=staff)
    thread.start()
    with mock.patch.object(services, "audit_record", audit_then_linger):
        booked = reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                    pool=node.pool, node_count=1, start=t0, end=t0 + timedelta(hours=2))
    thread.join(20)
    assert booked.node_count == 1
    assert isinstance(outcome["maintenance"], CapacityUnavailable), outcome
    assert Allocation.objects.filter(active=True).count() == 1
