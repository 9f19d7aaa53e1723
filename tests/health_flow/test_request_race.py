"""A check requested while the node's open check finishes is still queued, never silently left out."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from provisioning.health import services
from provisioning.health.choices import OPEN_CHECK_STATUSES, CheckStatus
from provisioning.health.models import HealthCheck


@pytest.mark.django_db(transaction=True)
def test_a_node_whose_open_check_finishes_between_insert_and_read_gets_a_new_check(fleet, monkeypatch):
    a, b = fleet.nodes[:2]
    (old,) = services.health_checks_request(nodes=[a], level="quick", trigger="schedule")
    real_insert = services._insert_checks
    rounds = []

    def insert_then_the_open_check_finishes(**kwargs):
        ids = real_insert(**kwargs)  # skips a: its scheduled check is open
        rounds.append(ids)
        if len(rounds) == 1:
            # Another worker records a's result and commits, before our read of the open checks.
            def finish():
                HealthCheck.objects.filter(pk=old.pk).update(status=CheckStatus.DONE, verdict="pass")
                connection.close()
            worker = threading.Thread(target=finish)
            worker.start()
            worker.join()
        return ids

    monkeypatch.setattr(services, "_insert_checks", insert_then_the_open_check_finishes)
    checks = services.health_checks_request(nodes=[a, b], level="quick", trigger="staff")
    assert {c.node_id for c in checks} == {a.pk, b.pk}, "a node was left out of the request"
    fresh = {c.node_id: c for c in checks}[a.pk]
    assert fresh.pk != old.pk and fresh.status in OPEN_CHECK_STATUSES and fresh.trigger == "staff"
    assert HealthCheck.objects.filter(node=a, status__in=OPEN_CHECK_STATUSES).count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["cancel", "swap"])
def test_a_tenants_check_racing_its_booking_letting_go_of_the_node_queues_nothing_there(fleet, now_slot, change):
    """A lead asks for a check of its running cluster's node while its booking lets go of that node (a cancel of
    the booking, a swap of the node to a spare), committed between the request's read of the nodes held and its
    insert. The check was queued all the same for the booking on a node it no longer held — free for, or booked
    by, another tenant at once — so that team's node was tested (a medium or full check loads its GPUs) and the
    first team read its results. The request now reads the booking under its lock: a cancel refuses it, and
    after a swap the node is not the cluster's."""
    from datetime import timedelta

    from portal.core.exceptions import InvalidInput, InvalidState
    from reservations.models import Allocation, Reservation
    from tests.health_flow.conftest import gate_cluster
    from tests.racing import behind_a_lock

    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], now_slot, now_slot + timedelta(hours=4))
    cluster = gate_cluster(booking)
    node = fleet.node("gpu-001")

    def lets_go() -> None:  # what reservation_cancel / a node swap writes, under the booking's lock
        locked = Reservation.objects.select_for_update().get(pk=booking.pk)
        held = Allocation.objects.filter(reservation=booking, active=True)
        if change == "cancel":
            locked.status = "cancelled"
            locked.save(update_fields=["status"])
            held.update(active=False)
        else:
            held.filter(node=node).update(active=False)
            Allocation.objects.create(reservation=booking, node=fleet.node("gpu-003"), period=booking.period)

    out = behind_a_lock(lets_go, lambda: services.cluster_health_checks_request(
        actor=fleet.users["alpha-lead"], cluster=cluster, level="medium", nodes=[node.hostname]))
    assert isinstance(out, InvalidState | InvalidInput), f"a check was queued: {out!r}"
    assert not HealthCheck.objects.filter(node=node, reservation=booking).exists()
