"""A booking racing a health drain of one of its chosen nodes never keeps the drained node (real threads,
real PostgreSQL): the drain waits for the booking and moves it off, or the booking sees the drain and
picks again."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection

from provisioning.constants import LOCK_BOOKING_NODE
from reservations.models import Allocation, Node
from reservations.services import node_replace_allocations, node_update, reservation_create
from tests.racing import advisory_waits, in_thread, pausing_inserts, until


def drain_in_other_session(node_id: int, out: dict) -> None:
    """What a health failure does, from another worker: drain the node, then move its bookings off it."""
    try:
        node = node_update(actor=None, node=Node.objects.get(pk=node_id), state="draining", reason="xid 79")
        out["done_at"] = time.monotonic()
        out["moved"] = node_replace_allocations(node=node, reason="xid 79")
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_drain_committed_between_choice_and_insert_sends_the_booking_elsewhere(fleet, tomorrow, eager):
    # Every node's booking lock is held here: the booking, having chosen its node, waits for its lock. This
    # session (another than the booking's; advisory locks are its own again) drains that node and commits.
    keys = [(LOCK_BOOKING_NODE, node.pk) for node in fleet.nodes]
    with connection.cursor() as cur:
        for key in keys:
            cur.execute("SELECT pg_advisory_lock(%s, %s)", key)
    out: dict = {}
    booking = _booking(fleet, tomorrow, out)
    until(lambda: not booking.is_alive() or advisory_waits(LOCK_BOOKING_NODE))
    victim = advisory_waits(LOCK_BOOKING_NODE)[0]
    node = node_update(actor=None, node=Node.objects.get(pk=victim), state="draining", reason="xid 79")
    moved = node_replace_allocations(node=node, reason="xid 79")
    with connection.cursor() as cur:
        for key in keys:
            cur.execute("SELECT pg_advisory_unlock(%s, %s)", key)
    booking.join(30)
    r = out["booking"]
    assert Node.objects.get(pk=victim).state == "draining"
    held = Allocation.objects.filter(reservation=r, active=True).values_list("node__hostname", "node__state")
    # The new booking must not hold a node drained for failing health.
    assert ("draining" not in {s for _, s in held}), list(held)
    assert len(held) == 1 and moved == []  # it booked another node; nothing was on the drained one


@pytest.mark.django_db(transaction=True)
def test_a_drain_during_the_booking_waits_for_it_then_moves_it_off(fleet, tomorrow, eager):
    drain: dict = {}
    out: dict = {}
    # The booking has inserted its allocation and holds its node's lock, uncommitted.
    with pausing_inserts("reservations_reservation") as pause:
        booking = _booking(fleet, tomorrow, out)
        pause.wait_reached()
        (node_id,) = pause.advisory_keys(LOCK_BOOKING_NODE)
        drain["node"] = node_id
        drain["thread"] = threading.Thread(target=drain_in_other_session, args=(node_id, drain))
        drain["thread"].start()
        time.sleep(0.5)
        assert "done_at" not in drain  # the state change waits for the booking
        drain["committing_at"] = time.monotonic()
        pause.release()
        booking.join(30)
    drain["thread"].join(30)
    r = out["booking"]
    assert drain["done_at"] >= drain["committing_at"]
    # Moved off the drained node: by the drain itself or by node_changed (run eagerly here) before it.
    from portal.core.models import AuditLog
    assert AuditLog.objects.filter(action="reservation.replace_node", object_id=str(r.pk)).count() == 1
    held = list(Allocation.objects.filter(reservation=r, active=True).values_list("node_id", "node__state"))
    assert len(held) == 1 and held[0][0] != drain["node"] and held[0][1] == "available"


def _booking(fleet, start, out: dict):
    return in_thread(out, "booking", lambda: reservation_create(
        actor=fleet.users["alpha-lead"], tenant=fleet.tenants["alpha"], pool=fleet.pool, node_count=1, start=start,
        end=start + timedelta(hours=2)))
