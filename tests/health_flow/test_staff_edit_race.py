"""A health step racing a staff edit of the same node (real threads, real PostgreSQL): the node's state
is decided under its lock, so what staff committed first stands — a retired node is never drained back
into service by a failing check, nor made available by its repair's rejoin."""

from __future__ import annotations

import pytest
from django.utils import timezone

from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import health_check_handle, repair_advance, repair_open
from reservations.models import Node
from reservations.services import _lock_nodes
from tests.racing import behind_a_lock


def staff_sets(node_id: int, state: str, reason: str):
    """A hold for behind_a_lock: staff's node_update to state, under the node's locks, not yet committed."""

    def hold() -> None:
        _lock_nodes([node_id])
        node = Node.objects.select_for_update().get(pk=node_id)
        node.state, node.state_reason = state, reason
        node.save()

    return hold


def staff_retires(node_id: int):
    return staff_sets(node_id, "retired", "decommissioned")


def failed_sweep_check(node) -> HealthCheck:
    """A scheduled quick check of node that failed (an uncorrected ECC error), not yet handled."""
    return HealthCheck.objects.create(
        node=node, level="quick", trigger="schedule", status="done", verdict="fail",
        recommended_action="drain_and_reset", summary="gpu2 ecc_uncorrected_volatile: 1 error",
        finished_at=timezone.now(),
    )


@pytest.mark.django_db(transaction=True)
def test_a_failing_check_does_not_drain_a_node_staff_retired_meanwhile(fleet):
    node = fleet.nodes[0]
    check = failed_sweep_check(node)
    # The check's consequences read the node as available, then wait for staff's retirement to commit.
    outcome = behind_a_lock(staff_retires(node.pk), lambda: health_check_handle(check.pk))
    assert outcome is None, outcome
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("retired", "decommissioned")
    assert not Repair.objects.filter(node=node).exists()  # as for a node found retired: nothing to repair
    assert HealthCheck.objects.get(pk=check.pk).handled_at is not None


@pytest.mark.django_db(transaction=True)
def test_a_rejoin_does_not_bring_back_a_node_staff_retired_meanwhile(fleet):
    staff = fleet.users["staff"]
    node = fleet.nodes[1]
    repair = repair_open(actor=staff, node=node, reason="NCCL hangs")
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    HealthCheck.objects.filter(pk=repair.retest_check_id).update(
        status="done", verdict="pass", finished_at=timezone.now(), handled_at=timezone.now())
    outcome = behind_a_lock(staff_retires(node.pk),
                            lambda: repair_advance(actor=staff, repair=repair, to="rejoined"))
    assert isinstance(outcome, Repair) and outcome.state == "rejoined", outcome
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("retired", "decommissioned")  # never given to bookings


@pytest.mark.django_db(transaction=True)
def test_a_failing_sweep_check_opens_no_repair_on_a_node_staff_put_in_maintenance_meanwhile(fleet, captured_events):
    node = fleet.nodes[2]
    check = failed_sweep_check(node)
    # The consequences read the node as available, then wait for staff's maintenance to commit.
    outcome = behind_a_lock(staff_sets(node.pk, "maintenance", "PSU swap"), lambda: health_check_handle(check.pk))
    assert outcome is None, outcome
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("maintenance", "PSU swap")
    assert not Repair.objects.filter(node=node).exists()
    assert HealthCheck.objects.get(pk=check.pk).handled_at is not None
    # Staff working on the node are told of the failure, as when the node was in maintenance already.
    told = [(name, p.get("check_id")) for name, p in captured_events if name in ("node.failed", "health_check.failed")]
    assert told == [("health_check.failed", check.pk)]


@pytest.mark.django_db(transaction=True)
def test_reconcile_does_not_undo_a_failed_staff_commit_meanwhile(fleet):
    from provisioning.health.services import repairs_reconcile

    staff = fleet.users["staff"]
    node = fleet.nodes[3]
    repair = repair_open(actor=staff, node=node, reason="NCCL hangs")
    Repair.objects.filter(pk=repair.pk).update(state="cordoned")  # the node's move to maintenance was lost
    # Reconcile reads the node as draining, then waits for staff's failed to commit.
    outcome = behind_a_lock(staff_sets(node.pk, "failed", "RMA"), repairs_reconcile)
    assert outcome == 0, outcome
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("failed", "RMA")
    assert Repair.objects.get(pk=repair.pk).state == "cordoned"
