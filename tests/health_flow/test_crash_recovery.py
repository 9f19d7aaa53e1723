"""A failing check whose consequences were cut short (the worker died after opening the repair) is finished
later by health_maintain — bookings moved, the failure announced — not silently (found in a review)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core import events
from provisioning.health import services as health
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.runner import SimulatedFleet
from reservations.models import Allocation, Node


@pytest.mark.django_db(transaction=True)
def test_a_check_cut_short_after_opening_its_repair_is_finished_and_announced(fleet, now_slot, monkeypatch):
    seen = []
    rec = lambda e, p: seen.append(e)  # noqa: E731
    events.subscribe("*", rec)
    try:
        fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=3))
        node = fleet.node("gpu-001")
        check = HealthCheck.objects.create(node=node, level="quick", trigger="schedule", status="running")
        report = SimulatedFleet({"nodes": {node.hostname: [{"kind": "remap_failure", "gpu": 4}]}}).run(
            {"id": check.pk, "host": node.hostname, "level": "quick", "model": "H100-SXM", "gpus": 8})
        assert report["verdict"] == "fail"

        def crash(**kw):
            raise RuntimeError("worker lost its DB connection / was killed here")

        monkeypatch.setattr(health, "node_replace_allocations", crash)
        with pytest.raises(RuntimeError):
            health.health_check_record(check.pk, report)
        monkeypatch.undo()
        # health_maintain finishes the check's consequences later (the documented recovery path).
        HealthCheck.objects.filter(pk=check.pk).update(finished_at=check.created_at - timedelta(minutes=5))
        health.health_maintain()
        assert HealthCheck.objects.get(pk=check.pk).handled_at is not None
        assert Repair.objects.filter(node=node).exists()
        assert Node.objects.get(pk=node.pk).state == "draining"
        assert {"node.failed", "health_check.failed"} <= set(seen), seen
        assert not Allocation.objects.filter(node=node, active=True, period__endswith__gt=timezone.now()).exists()
    finally:
        events.unsubscribe("*", rec)


@pytest.fixture
def deadlocking_moves_of():
    """Have PostgreSQL fail the first `times` spare allocations of one booking with 40P01 (a trigger; a sequence,
    which a rollback does not undo, counts them), as a swap losing deadlocks to a concurrent change would."""
    from django.db import connection

    made = []

    def make(reservation_id: int, times: int) -> None:
        assert not made, "one booking at a time"
        with connection.cursor() as cur:
            cur.execute("CREATE SEQUENCE test_move_deadlocks")
            cur.execute("CREATE FUNCTION test_move_deadlocks() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                        f" IF NEW.reservation_id = {int(reservation_id)}"
                        f" AND nextval('test_move_deadlocks') <= {int(times)} THEN"
                        " RAISE EXCEPTION 'deadlock detected' USING ERRCODE = 'deadlock_detected'; END IF;"
                        " RETURN NEW; END $$")
            cur.execute("CREATE TRIGGER test_move_deadlocks BEFORE INSERT ON reservations_allocation"
                        " FOR EACH ROW EXECUTE FUNCTION test_move_deadlocks()")
        made.append(reservation_id)

    yield make
    if made:
        with connection.cursor() as cur:
            cur.execute("DROP TRIGGER test_move_deadlocks ON reservations_allocation;"
                        " DROP FUNCTION test_move_deadlocks(); DROP SEQUENCE test_move_deadlocks")


@pytest.mark.django_db(transaction=True)
def test_a_move_that_keeps_losing_deadlocks_is_finished_by_the_handlings_rerun(fleet, now_slot, settings,
                                                                               deadlocking_moves_of):
    """A failing node's bookings are moved one by one; one whose move keeps losing deadlocks (Busy) leaves the
    handling unfinished (the check stored, not handled). The re-run (health_maintain) moves what is left, and the repair
    and the announcement name every booking moved, the ones moved in the first run too."""
    seen = []
    rec = lambda e, p: seen.append((e, p))  # noqa: E731
    events.subscribe("*", rec)
    try:
        settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
        first = fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=3))
        second = fleet.book("beta", ["gpu-001"], now_slot + timedelta(hours=4), now_slot + timedelta(hours=6),
                            status="confirmed")
        node = fleet.node("gpu-001")
        check = HealthCheck.objects.create(node=node, level="quick", trigger="schedule", status="running")
        report = SimulatedFleet({"nodes": {node.hostname: [{"kind": "remap_failure", "gpu": 4}]}}).run(
            {"id": check.pk, "host": node.hostname, "level": "quick", "model": "H100-SXM", "gpus": 8})
        deadlocking_moves_of(second.pk, times=2)  # every attempt of the second booking's move loses

        health.health_check_record(check.pk, report)  # stored; its handling left for the upkeep
        assert HealthCheck.objects.get(pk=check.pk).status == "done"
        assert HealthCheck.objects.get(pk=check.pk).handled_at is None
        assert Allocation.objects.filter(reservation=second, node=node, active=True).exists()  # not moved yet
        assert not Allocation.objects.filter(reservation=first, node=node, active=True).exists()  # moved

        HealthCheck.objects.filter(pk=check.pk).update(finished_at=check.created_at - timedelta(minutes=5))
        health.health_maintain()
        assert HealthCheck.objects.get(pk=check.pk).handled_at is not None
        for booking in (first, second):
            held = Allocation.objects.filter(reservation=booking, active=True)
            assert held.count() == 1 and held.get().node_id != node.pk
        repair = Repair.objects.get(node=node)
        assert sorted((o["reservation_id"], o["result"]) for o in repair.outcomes) == [
            (first.pk, "replaced"), (second.pk, "replaced")]
        [(_, failed)] = [(e, p) for e, p in seen if e == "node.failed"]
        assert sorted(failed["tenant_ids"]) == sorted([fleet.tenants["alpha"].pk, fleet.tenants["beta"].pk])
        assert sorted(o["reservation_id"] for o in failed["outcomes"]) == [first.pk, second.pk]
    finally:
        events.unsubscribe("*", rec)


def _failing_check(node):
    check = HealthCheck.objects.create(node=node, level="quick", trigger="schedule", status="running")
    report = SimulatedFleet({"nodes": {node.hostname: [{"kind": "remap_failure", "gpu": 4}]}}).run(
        {"id": check.pk, "host": node.hostname, "level": "quick", "model": "H100-SXM", "gpus": 8})
    return check, report


@pytest.mark.django_db(transaction=True)
def test_a_node_whose_moves_keep_losing_does_not_hold_up_the_other_failing_nodes(fleet, now_slot, settings,
                                                                               deadlocking_moves_of):
    """Checks recorded together (the fleet's batch) are handled one by one, and the upkeep finishes every unhandled
    one: a node whose move stays busy stopped the handling of every check after it, and the upkeep's run there
    (the rest of the checks, the repairs' reconcile, the prune) with it. Each one is handled or left for the next
    run on its own."""
    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    stuck = fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=3))
    other = fleet.book("beta", ["gpu-002"], now_slot, now_slot + timedelta(hours=3))
    (first, first_report), (second, second_report) = _failing_check(fleet.node("gpu-001")), \
        _failing_check(fleet.node("gpu-002"))
    deadlocking_moves_of(stuck.pk, times=4)  # two handlings' attempts

    result = health.health_checks_record([(first.pk, first_report), (second.pk, second_report)])
    assert result == {"recorded": 2, "handled": 1}
    assert HealthCheck.objects.get(pk=second.pk).handled_at is not None
    assert not Allocation.objects.filter(reservation=other, node__hostname="gpu-002", active=True).exists()
    assert Allocation.objects.filter(reservation=other, active=True).count() == 1

    HealthCheck.objects.filter(pk=first.pk).update(finished_at=first.created_at - timedelta(minutes=5))
    stale = HealthCheck.objects.create(node=fleet.node("gpu-003"), level="quick", trigger="schedule", status="done",
                                       verdict="pass", finished_at=first.created_at - timedelta(minutes=5))
    result = health.health_maintain()  # the stuck node's move loses again: the upkeep still does the rest
    assert result["handled"] == 2
    assert HealthCheck.objects.get(pk=first.pk).handled_at is None
    assert HealthCheck.objects.get(pk=stale.pk).handled_at is not None

    health.health_maintain()
    assert HealthCheck.objects.get(pk=first.pk).handled_at is not None
    held = Allocation.objects.filter(reservation=stuck, active=True)
    assert held.count() == 1 and held.get().node.hostname != "gpu-001"


@pytest.mark.django_db(transaction=True)
def test_a_repair_step_whose_move_stays_busy_is_taken_and_the_move_follows(fleet, now_slot, settings,
                                                                          deadlocking_moves_of):
    """A repair step that takes the node further out (cordoned: maintenance) moves its bookings off after the
    step and the node's change are committed. A move that kept losing deadlocks raised Busy out of the step:
    staff read "nothing was changed, try again" of a step that was taken (and trying it again was refused).
    The step stands; the move is left to the node's sync (node.state_changed), which moves what is left."""
    from provisioning import services as provisioning
    from provisioning.health.services import repair_advance, repair_open

    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    settings.PORTAL_HEALTH_MOVE_BOOKINGS = False  # the repair's opening leaves the booking where it is
    staff = fleet.users["staff"]
    booking = fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=3))
    repair = repair_open(actor=staff, node=fleet.node("gpu-001"), reason="XID 79")
    repair = repair_advance(actor=staff, repair=repair, to="accepted")
    settings.PORTAL_HEALTH_MOVE_BOOKINGS = True
    deadlocking_moves_of(booking.pk, times=2)

    repair = repair_advance(actor=staff, repair=repair, to="cordoned")
    assert Repair.objects.get(pk=repair.pk).state == "cordoned"
    assert Node.objects.get(hostname="gpu-001").state == "maintenance"
    assert Allocation.objects.filter(reservation=booking, node__hostname="gpu-001", active=True).exists()
    assert health.repairs_reconcile() == 0  # nothing left undone by the step itself

    assert provisioning.node_sync(node_id=fleet.node("gpu-001").pk) == {"replaced": 1}  # node.state_changed's task
    held = Allocation.objects.filter(reservation=booking, active=True)
    assert held.count() == 1 and held.get().node.hostname != "gpu-001"


@pytest.mark.django_db(transaction=True)
def test_a_repair_opened_by_staff_whose_move_stays_busy_is_opened_and_the_move_follows(fleet, now_slot, settings,
                                                                                      deadlocking_moves_of):
    """Staff opening a repair drains the node and opens the repair (committed) before moving its bookings. A move
    that kept losing deadlocks answered "busy, nothing was changed, try again": trying again was refused (the node
    has an open repair). The repair is opened; the node's sync (node.state_changed) moves what is left."""
    from provisioning import services as provisioning
    from provisioning.health.services import repair_open

    settings.PORTAL_BOOKING_MAX_ATTEMPTS = 2
    booking = fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=3))
    deadlocking_moves_of(booking.pk, times=2)

    repair = repair_open(actor=fleet.users["staff"], node=fleet.node("gpu-001"), reason="XID 79")
    assert Repair.objects.get(pk=repair.pk).is_open
    assert Node.objects.get(hostname="gpu-001").state == "draining"
    assert Allocation.objects.filter(reservation=booking, node__hostname="gpu-001", active=True).exists()

    assert provisioning.node_sync(node_id=fleet.node("gpu-001").pk) == {"replaced": 1}  # node.state_changed's task
    held = Allocation.objects.filter(reservation=booking, active=True)
    assert held.count() == 1 and held.get().node.hostname != "gpu-001"
