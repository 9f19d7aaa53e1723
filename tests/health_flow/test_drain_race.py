"""A booking racing a health drain of one of its chosen nodes never keeps the drained node (real threads,
real PostgreSQL): the drain waits for the booking and moves it off, or the booking sees the drain and
picks again."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection

from reservations import selectors
from reservations.models import Allocation, Node
from reservations.services import node_replace_allocations, node_update, reservation_create


def drain_in_other_session(node_id: int, out: dict) -> None:
    """What a health failure does, from another worker: drain the node, then move its bookings off it."""
    try:
        node = node_update(actor=None, node=Node.objects.get(pk=node_id), state="draining", reason="xid 79")
        out["done_at"] = time.monotonic()
        out["moved"] = node_replace_allocations(node=node, reason="xid 79")
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_drain_committed_between_choice_and_insert_sends_the_booking_elsewhere(fleet, tomorrow, eager, monkeypatch):
    real = selectors.free_nodes
    victim = {}

    def free_nodes_then_drain(**kw):
        rows = real(**kw)
        if not victim:
            victim["id"] = rows[0][0]
            t = threading.Thread(target=drain_in_other_session, args=(rows[0][0], victim))
            t.start()
            t.join(30)
        return rows

    monkeypatch.setattr(selectors, "free_nodes", free_nodes_then_drain)
    r = reservation_create(actor=fleet.users["alpha-lead"], tenant=fleet.tenants["alpha"], pool=fleet.pool,
                           node_count=1, start=tomorrow, end=tomorrow + timedelta(hours=2))
    node = Node.objects.get(pk=victim["id"])
    assert node.state == "draining"
    held = Allocation.objects.filter(reservation=r, active=True).values_list("node__hostname", "node__state")
    # The new booking must not hold a node drained for failing health.
    assert ("draining" not in {s for _, s in held}), list(held)
    assert len(held) == 1 and victim["moved"] == []  # it booked another node; nothing was on the drained one


@pytest.mark.django_db(transaction=True)
def test_a_drain_during_the_booking_waits_for_it_then_moves_it_off(fleet, tomorrow, eager, monkeypatch):
    from reservations import services

    real_audit = services.audit_record
    drain = {}

    def audit_then_drain(**kw):
        # The booking has inserted its allocation and holds its node's lock, uncommitted.
        if kw["action"] == "reservation.create" and not drain:
            node_id = Allocation.objects.get(reservation_id=kw["obj"].pk).node_id
            drain["node"] = node_id
            drain["thread"] = threading.Thread(target=drain_in_other_session, args=(node_id, drain))
            drain["thread"].start()
            time.sleep(0.5)
            assert "done_at" not in drain  # the state change waits for the booking
            drain["committing_at"] = time.monotonic()
        return real_audit(**kw)

    monkeypatch.setattr(services, "audit_record", audit_then_drain)
    r = reservation_create(actor=fleet.users["alpha-lead"], tenant=fleet.tenants["alpha"], pool=fleet.pool,
                           node_count=1, start=tomorrow, end=tomorrow + timedelta(hours=2))
    drain["thread"].join(30)
    assert drain["done_at"] >= drain["committing_at"]
    # Moved off the drained node: by the drain itself or by node_changed (run eagerly here) before it.
    from portal.core.models import AuditLog
    assert AuditLog.objects.filter(action="reservation.replace_node", object_id=str(r.pk)).count() == 1
    held = list(Allocation.objects.filter(reservation=r, active=True).values_list("node_id", "node__state"))
    assert len(held) == 1 and held[0][0] != drain["node"] and held[0][1] == "available"
