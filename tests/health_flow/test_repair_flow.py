"""A failing check opens a repair; staff take it through every step to rejoin, each audited."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
from django.test import Client

from portal.core.exceptions import InvalidState, PermissionDenied
from portal.core.models import AuditLog
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import (
    health_checks_request,
    health_sweep,
    repair_advance,
    repair_open,
    repairs_reconcile,
)
from reservations.models import Allocation, Node
from reservations.services import node_update

from .conftest import fleet_spec, gate_cluster

ECC = [{"kind": "ecc_uncorrected", "gpu": 2}]


def _run(callbacks, **kwargs):
    with callbacks(execute=True):
        return health_checks_request(**kwargs)



def _fixed_and_retested(cb, repair, spec, staff):
    """The node's fault is gone (the fleet spec rewritten healthy, its mtime moved so it is read again): the
    repair's re-test runs and passes; return the repair."""
    time.sleep(0.01)
    spec.write_text(fleet_spec())
    os.utime(spec, (time.time() - 60, time.time() - 60))
    repair = _step(cb, repair, "retesting", staff)
    repair.refresh_from_db()
    assert repair.retest_check.verdict == "pass"
    return repair

def _step(callbacks, repair, to, actor, note=""):
    with callbacks(execute=True):
        return repair_advance(actor=actor, repair=repair, to=to, note=note)


@pytest.mark.django_db
def test_repair_goes_from_failing_check_to_rejoin(fleet, settings, eager, now_slot, captured_events,
                                                  django_capture_on_commit_callbacks):
    cb = django_capture_on_commit_callbacks
    staff = fleet.users["staff"]
    victim = fleet.nodes[0]
    running = fleet.book("alpha", [victim.hostname], now_slot, now_slot + timedelta(hours=6))
    settings.PORTAL_FAKE_NVML = fleet_spec({victim.hostname: ECC})

    [check] = _run(cb, nodes=[victim], level="quick", trigger="schedule")
    check.refresh_from_db()
    assert check.verdict == "fail" and check.recommended_action == "drain_and_reset"
    repair = Repair.objects.get(node=victim)
    victim.refresh_from_db()
    assert victim.state == "draining"
    # The running booking's rest of the window moved to a spare.
    [outcome] = repair.outcomes
    assert outcome["result"] == "replaced" and outcome["spare"] != victim.hostname
    assert Allocation.objects.filter(reservation=running, node__hostname=outcome["spare"], active=True).exists()

    with pytest.raises(PermissionDenied):
        repair_advance(actor=fleet.users["alpha-lead"], repair=repair, to="accepted")
    with pytest.raises(InvalidState):
        repair_advance(actor=staff, repair=repair, to="rejoined")

    _step(cb, repair, "accepted", staff, "looking into it")
    repair = _step(cb, repair, "cordoned", staff)
    victim.refresh_from_db()
    assert victim.state == "maintenance"
    repair = _step(cb, repair, "remediating", staff, "reset GPU 2")
    assert repair.remediated_at is not None
    with pytest.raises(InvalidState):
        repair_advance(actor=staff, repair=repair, to="rejoined")
    # Re-testing without running the agent: rejoining must wait for a passing result.
    repair = repair_advance(actor=staff, repair=repair, to="retesting")
    with pytest.raises(InvalidState, match="passing re-test"):
        repair_advance(actor=staff, repair=repair, to="rejoined")
    with django_capture_on_commit_callbacks(execute=True):
        from provisioning.health.services import dispatch

        dispatch([repair.retest_check_id])
    retest = HealthCheck.objects.get(pk=repair.retest_check_id)
    # The simulated node was remediated: its faults are gone, the medium re-test passes.
    assert (retest.level, retest.trigger, retest.status, retest.verdict) == ("medium", "repair", "done", "pass")
    assert "dcgm_diag" in retest.report["parts_ran"]
    repair.refresh_from_db()
    assert repair.state == "retesting" and "re-test" in repair.steps[-1]["note"]
    repair = _step(cb, repair, "rejoined", staff, "back in service")
    victim.refresh_from_db()
    assert victim.state == "available" and victim.state_reason == ""
    assert repair.closed_at is not None

    assert [s["state"] for s in repair.steps] == [
        "recommended", "accepted", "cordoned", "remediating", "retesting", "retesting", "rejoined"]
    assert [s["actor"] for s in repair.steps] == [None, *[staff.username] * 4, None, staff.username]
    audited = list(AuditLog.objects.filter(object_type="health.repair", object_id=str(repair.pk))
                   .order_by("id").values_list("action", flat=True))
    assert audited == ["repair.recommended", "repair.accepted", "repair.cordoned", "repair.remediating",
                       "repair.retesting", "repair.retest_passed", "repair.rejoined"]
    states = [(p["previous"], p["state"]) for name, p in captured_events if name == "repair.changed"]
    assert states[0] == ("", "recommended") and states[-1] == ("retesting", "rejoined")
    node_states = [p["new"] for name, p in captured_events if name == "node.state_changed"]
    assert node_states == ["draining", "maintenance", "available"]


@pytest.mark.django_db
def test_failed_retest_goes_back_to_remediation(fleet, settings, eager, tmp_path,
                                                django_capture_on_commit_callbacks):
    """New faults injected after the remediation (the spec file changes) fail the re-test."""
    cb = django_capture_on_commit_callbacks
    staff = fleet.users["staff"]
    victim = fleet.nodes[0]
    spec = tmp_path / "fleet.json"
    spec.write_text(fleet_spec({victim.hostname: ECC}))
    settings.PORTAL_FAKE_NVML = f"@{spec}"
    _run(cb, nodes=[victim], level="quick", trigger="schedule")
    repair = Repair.objects.get(node=victim)
    for to in ("accepted", "cordoned", "remediating"):
        repair = _step(cb, repair, to, staff)
    # Someone injects another fault after the remediation started.
    spec.write_text(fleet_spec({victim.hostname: [{"kind": "nvlink_down", "gpu": 1, "link": 3}]}))
    later = time.time() + 5
    os.utime(spec, (later, later))
    repair = _step(cb, repair, "retesting", staff)
    repair.refresh_from_db()
    retest = repair.retest_check
    assert retest.verdict == "fail" and "nvlink_state" in retest.summary
    assert repair.state == "remediating" and "re-test" in repair.steps[-1]["note"]
    victim.refresh_from_db()
    assert victim.state == "maintenance"  # still out, still one repair
    assert Repair.objects.filter(node=victim).count() == 1
    # A second round: fixed for real this time.
    repair = _fixed_and_retested(cb, repair, spec, staff)
    _step(cb, repair, "rejoined", staff)
    victim.refresh_from_db()
    assert victim.state == "available"


@pytest.mark.django_db
def test_giving_up_marks_the_node_failed(fleet, captured_events, django_capture_on_commit_callbacks, tomorrow):
    staff = fleet.users["staff"]
    node = fleet.nodes[2]
    booking = fleet.book("beta", [node.hostname], tomorrow, tomorrow + timedelta(hours=2), status="confirmed")
    with django_capture_on_commit_callbacks(execute=True):
        repair = repair_open(actor=staff, node=node, reason="NCCL hangs reported by the tenant")
    node.refresh_from_db()
    assert node.state == "draining" and repair.triggering_check is None
    assert not Allocation.objects.filter(reservation=booking, node=node, active=True).exists()
    with pytest.raises(InvalidState):
        repair_open(actor=staff, node=node, reason="again")
    with pytest.raises(PermissionDenied):
        repair_open(actor=fleet.users["beta-lead"], node=fleet.nodes[3], reason="mine")
    with django_capture_on_commit_callbacks(execute=True):
        repair = repair_advance(actor=staff, repair=repair, to="failed", note="RMA")
    node.refresh_from_db()
    assert node.state == "failed" and repair.closed_at is not None
    failed = [p for name, p in captured_events if name == "node.failed"]
    assert failed[-1]["state"] == "failed" and failed[-1]["repair_id"] == repair.pk
    with pytest.raises(InvalidState):
        repair_advance(actor=staff, repair=repair, to="accepted")


@pytest.mark.django_db
def test_reconcile_brings_the_node_to_its_repair_state(fleet):
    """A worker that died between the repair's step and the node's change is caught up by upkeep."""
    staff = fleet.users["staff"]
    node = fleet.nodes[0]
    repair = repair_open(actor=staff, node=node, reason="manual")
    Repair.objects.filter(pk=repair.pk).update(state="cordoned")  # as if the node update was lost
    assert repairs_reconcile() == 1
    node.refresh_from_db()
    assert node.state == "maintenance"
    assert repairs_reconcile() == 0
    # Putting the node back while its repair is open is refused (node_return_blockers)...
    with pytest.raises(InvalidState, match=f"repair #{repair.pk}"):
        node_update(actor=staff, node=Node.objects.get(pk=node.pk), state="available")
    # ...and one that got there anyway (a hand edit of the row): the repair still owns it.
    Node.objects.filter(pk=node.pk).update(state="available")
    assert repairs_reconcile() == 1
    node.refresh_from_db()
    assert node.state == "maintenance"


def test_fleet_spec_helper_is_json():
    assert json.loads(fleet_spec({"a": ECC}))["nodes"]["a"] == ECC


@pytest.mark.django_db
def test_a_reused_open_check_counts_as_the_retest(fleet):
    """Re-testing while a staff medium check is already queued reuses it; its result moves the repair."""
    from provisioning.health.runner import SimulatedFleet
    from provisioning.health.services import health_check_record, node_health_check_request

    staff = fleet.users["staff"]
    node = fleet.nodes[1]
    repair = repair_open(actor=staff, node=node, reason="manual")
    for to in ("accepted", "cordoned", "remediating"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    queued = node_health_check_request(actor=staff, node=node, level="medium")  # not run yet
    repair = repair_advance(actor=staff, repair=repair, to="retesting")
    assert repair.retest_check_id == queued.pk and queued.trigger == "staff"
    report = SimulatedFleet("").run({"id": queued.pk, "host": node.hostname, "level": "medium",
                                     "model": "H100-SXM", "gpus": 8})
    health_check_record(queued.pk, report)
    repair.refresh_from_db()
    assert repair.state == "retesting" and "pass" in repair.steps[-1]["note"]
    repair = repair_advance(actor=staff, repair=repair, to="rejoined")
    node.refresh_from_db()
    assert node.state == "available"


@pytest.mark.django_db
def test_an_overlong_repair_reason_is_refused_and_nothing_changes(fleet):
    from portal.core.exceptions import InvalidInput
    from provisioning.health.models import Repair

    node = fleet.nodes[1]
    with pytest.raises(InvalidInput) as exc:
        repair_open(actor=fleet.users["staff"], node=node, reason="x" * 100_000)
    assert exc.value.fields == {"reason": "At most 500 characters."}
    node.refresh_from_db()
    assert node.state == "available" and not Repair.objects.filter(node=node).exists()
    assert repair_open(actor=fleet.users["staff"], node=node, reason="y" * 500).reason == "y" * 500


@pytest.mark.django_db
def test_reconcile_leaves_a_node_staff_changed_after_its_repair_closed(fleet, captured_events,
                                                                      django_capture_on_commit_callbacks):
    """Upkeep catches up a node whose repair closed without the node following; it must not undo what
    staff did to the node afterwards: a failed node put back by hand stayed failed for a day (the beat
    failed it again every minute and announced node.failed each time), a rejoined node sent to
    maintenance by hand went back to bookings."""
    staff = fleet.users["staff"]
    broken, rejoined = fleet.nodes[0], fleet.nodes[1]
    repair = repair_open(actor=staff, node=broken, reason="NCCL hangs")
    repair_advance(actor=staff, repair=repair, to="failed", note="RMA")
    assert Node.objects.get(pk=broken.pk).state == "failed"
    # The board came back from RMA: staff put the node in service again.
    node_update(actor=staff, node=Node.objects.get(pk=broken.pk), state="available", reason="")

    repair = repair_open(actor=staff, node=rejoined, reason="manual")
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    HealthCheck.objects.filter(pk=repair.retest_check_id).update(status="done", verdict="pass")
    repair_advance(actor=staff, repair=repair, to="rejoined")
    assert Node.objects.get(pk=rejoined.pk).state == "available"
    node_update(actor=staff, node=Node.objects.get(pk=rejoined.pk), state="maintenance", reason="PSU swap")

    # A third repair closed as failed by a worker that died before its node followed: still caught up.
    lost = repair_open(actor=staff, node=fleet.nodes[2], reason="lost step")
    from django.utils import timezone
    Repair.objects.filter(pk=lost.pk).update(state="failed", closed_at=timezone.now())

    failed_before = sum(1 for name, _ in captured_events if name == "node.failed")
    with django_capture_on_commit_callbacks(execute=True):
        assert repairs_reconcile() == 1
    assert Node.objects.get(pk=fleet.nodes[2].pk).state == "failed"
    failed_before += 1
    assert Node.objects.get(pk=broken.pk).state == "available"
    assert Node.objects.get(pk=rejoined.pk).state == "maintenance"
    assert sum(1 for name, _ in captured_events if name == "node.failed") == failed_before


@pytest.mark.django_db
def test_a_retest_is_a_check_queued_after_the_remediation(fleet):
    """Back to remediation while the re-test was still queued, then re-test again: the open check from
    before the second remediation was reused as the re-test (its result, read before the fix, rejoined the
    node or sent it back). It is closed as superseded and a new check is the re-test."""
    staff = fleet.users["staff"]
    node = fleet.nodes[2]
    repair = repair_open(actor=staff, node=node, reason="manual")
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    first = repair.retest_check  # queued, not run yet (the node's agent is busy, or the node is down)
    repair = repair_advance(actor=staff, repair=repair, to="remediating", note="forgot the riser")
    repair = repair_advance(actor=staff, repair=repair, to="retesting")
    assert repair.retest_check_id != first.pk
    assert repair.retest_check.created_at >= repair.remediated_at and repair.retest_check.is_open
    first.refresh_from_db()
    assert (first.status, first.verdict) == ("error", "unknown") and "superseded" in first.error
    assert first.handled_at is not None
    # Its agent's late report changes nothing; the new check's result moves the repair.
    from provisioning.health.runner import SimulatedFleet
    from provisioning.health.services import health_check_record

    report = SimulatedFleet("").run({"id": first.pk, "host": node.hostname, "level": "medium",
                                     "model": "H100-SXM", "gpus": 8})
    health_check_record(first.pk, report)
    first.refresh_from_db()
    repair.refresh_from_db()
    assert first.status == "error" and repair.state == "retesting"
    with pytest.raises(InvalidState, match="passing re-test"):
        repair_advance(actor=staff, repair=repair, to="rejoined")


@pytest.mark.django_db
def test_a_sweep_at_a_bookings_end_does_not_drain_the_node_its_cluster_still_runs_on(
        fleet, settings, eager, now_slot, django_capture_on_commit_callbacks):
    """A booking's window is over, but its cluster is still on the node (the minute's tick has not ended it,
    or its teardown runs): the tenant's jobs still run there. The sweep told the agent the node should be
    idle, read those jobs as stray processes, failed the node and drained it into a repair."""
    from provisioning.models import VirtualCluster

    from .test_api import make_cluster

    node = fleet.nodes[0]
    ended = fleet.book("alpha", [node.hostname], now_slot - timedelta(hours=3), now_slot)  # still "active"
    cluster = make_cluster(ended)
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: [{"kind": "stray_process", "gpu": 0, "pid": 4242}]})
    for status, reservation_status in (("ready", "active"), ("tearing_down", "ending")):
        VirtualCluster.objects.filter(pk=cluster.pk).update(status=status)
        type(ended).objects.filter(pk=ended.pk).update(status=reservation_status)
        [check] = _run(django_capture_on_commit_callbacks, nodes=[node], level="quick", trigger="schedule")
        check.refresh_from_db()
        assert check.verdict == "pass", (status, check.summary)
        assert Node.objects.get(pk=node.pk).state == "available" and not Repair.objects.filter(node=node).exists()
    # Torn down: a process left on the node now is a stray one.
    VirtualCluster.objects.filter(pk=cluster.pk).update(status="deleted")
    type(ended).objects.filter(pk=ended.pk).update(status="completed")
    [check] = _run(django_capture_on_commit_callbacks, nodes=[node], level="quick", trigger="schedule")
    check.refresh_from_db()
    assert check.verdict == "fail" and "compute_processes" in check.summary
    assert Node.objects.get(pk=node.pk).state == "draining"


@pytest.mark.django_db
def test_upkeep_leaves_a_node_staff_failed_while_its_repair_is_open(fleet, captured_events,
                                                                    django_capture_on_commit_callbacks):
    """Staff marked a node under an open repair failed (the board goes back to the vendor): within a minute
    the upkeep's reconcile moved it back to maintenance, as the repair's step implies; only retired stood.
    Staff's failed stands; the repair stays open (staff close or continue it)."""
    from provisioning.health.services import health_maintain

    staff = fleet.users["staff"]
    node = fleet.nodes[0]
    repair = repair_open(actor=staff, node=node, reason="NCCL hangs")
    for to in ("accepted", "cordoned"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    assert Node.objects.get(pk=node.pk).state == "maintenance"
    node_update(actor=staff, node=Node.objects.get(pk=node.pk), state="failed", reason="RMA")
    with django_capture_on_commit_callbacks(execute=True):
        health_maintain()
        assert repairs_reconcile() == 0
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("failed", "RMA")
    repair.refresh_from_db()
    assert repair.is_open and repair.state == "cordoned"
    assert not [p for name, p in captured_events if name == "node.state_changed" and p["old"] == "failed"]
    # Staff's own step of the repair still moves the node (an explicit decision on the repair).
    repair = repair_advance(actor=staff, repair=repair, to="remediating")
    assert Node.objects.get(pk=node.pk).state == "maintenance"


def _held_after_a_failed_teardown(fleet, node, now_slot):
    """Hold the node as provisioning does when a cluster's teardown failed for good: maintenance, the portal's
    own reason ("teardown of cluster #N failed: held until its teardown is retried"); return the cluster."""
    from provisioning.models import VirtualCluster
    from provisioning.services import _hold_nodes_of_failed_teardown

    booking = fleet.book("alpha", [node.hostname], now_slot - timedelta(hours=3), now_slot - timedelta(hours=1),
                         status="failed")
    cluster = VirtualCluster.objects.create(
        reservation=booking, tenant=booking.tenant, status="failed", failed_during="teardown", backend="simulated",
        orchestrator="slurm", orchestrator_version="24.11", cuda_version="12.8", default_memory_per_gpu_gib=80,
        shared_storage_gib=100,
    )
    _hold_nodes_of_failed_teardown(cluster.pk, (node.hostname,), "the backend refused")
    node.refresh_from_db()
    assert node.state == "maintenance" and node.state_reason.startswith(f"teardown of cluster #{cluster.pk} failed")
    return cluster


@pytest.mark.django_db
def test_a_failing_sweep_of_a_node_held_after_a_failed_teardown_opens_a_repair(
        fleet, settings, eager, now_slot, captured_events, django_capture_on_commit_callbacks):
    """A node the portal itself holds in maintenance after a failed teardown read as staff's hands-on
    maintenance to the sweep: its failing check opened no repair, and the retried teardown's release then put
    the node with failing GPUs back in service. The portal's hold is no staff work: the failure opens a repair,
    which keeps the node out through the release, until its re-test passes."""
    from provisioning.services import _release_nodes_of_failed_teardown

    node = fleet.nodes[1]
    cluster = _held_after_a_failed_teardown(fleet, node, now_slot)
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: ECC})
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()
    check = HealthCheck.objects.get(node=node)
    assert (check.verdict, check.handled_at is not None) == ("fail", True)
    repair = Repair.objects.get(node=node)
    assert repair.triggering_check_id == check.pk and repair.state == "recommended"
    assert "node.failed" in [name for name, _ in captured_events]
    node.refresh_from_db()
    assert node.state == "maintenance"  # held, not drained: the failed tenant's cluster is still on it
    # The teardown is retried and succeeds: the repair keeps the node out.
    cluster.status = "deleted"
    cluster.save(update_fields=["status"])
    _release_nodes_of_failed_teardown(cluster.pk)
    assert Node.objects.get(pk=node.pk).state == "maintenance"


@pytest.mark.django_db
def test_a_repair_rejoining_a_node_still_held_after_a_failed_teardown_leaves_it_held(
        fleet, settings, eager, now_slot, django_capture_on_commit_callbacks):
    """A repair on a held node (a staff check failed there, or a sweep) rejoined it — made it available for the
    next booking — while the failed tenant's cluster, credentials and mounts were still on it. The rejoin now
    closes the repair and leaves the node held; the retried teardown's release gives it back."""
    from provisioning.services import _release_nodes_of_failed_teardown

    cb = django_capture_on_commit_callbacks
    staff = fleet.users["staff"]
    node = fleet.nodes[1]
    cluster = _held_after_a_failed_teardown(fleet, node, now_slot)
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: ECC})
    _run(cb, nodes=[node], level="quick", trigger="staff", actor=staff)
    repair = Repair.objects.get(node=node)
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = _step(cb, repair, to, staff)
    settings.PORTAL_FAKE_NVML = fleet_spec()
    with cb(execute=True):
        from provisioning.health.services import dispatch

        dispatch([repair.retest_check_id])
    assert HealthCheck.objects.get(pk=repair.retest_check_id).verdict == "pass"
    # Through the repair's page: its message said "Repair #N: rejoined." while the node stayed out of service.
    client = Client()
    client.force_login(staff)
    with cb(execute=True):
        page = client.post(f"/health/repairs/{repair.pk}/step/", {"to": "rejoined", "note": "GPUs fine"}, follow=True)
    (message,) = [str(m) for m in page.context["messages"]]
    assert message == (f"Repair #{repair.pk}: rejoined. {node.hostname} stays held in maintenance: the teardown "
                       f"of cluster #{cluster.pk} failed and the tenant's cluster may still be on it; it is given "
                       "back when a retried teardown succeeds.")
    repair = Repair.objects.get(pk=repair.pk)
    assert repair.state == "rejoined" and repair.closed_at is not None
    node.refresh_from_db()
    assert node.state == "maintenance"
    assert node.state_reason.startswith(f"teardown of cluster #{cluster.pk} failed")
    assert repairs_reconcile() == 0 and Node.objects.get(pk=node.pk).state == "maintenance"
    # The teardown is retried and succeeds: now the node is given back.
    cluster.status = "deleted"
    cluster.save(update_fields=["status"])
    _release_nodes_of_failed_teardown(cluster.pk)
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("available", "")


@pytest.mark.django_db
def test_the_failed_tenants_processes_on_a_node_held_after_its_teardown_failed_are_no_stray_processes(
        fleet, settings, eager, now_slot, captured_events, django_capture_on_commit_callbacks):
    """A teardown that failed for good leaves the tenant's cluster, and its jobs, on the node: that is why the
    node is held. The checks' job still said the node should be idle (only ready, degraded or tearing-down
    clusters counted), so those jobs read as stray compute processes: a failing check (drain_and_reset) and,
    with the hold no longer staff maintenance, a repair for what is no hardware fault."""
    from provisioning.health.services import jobs_for

    node = fleet.nodes[1]
    _held_after_a_failed_teardown(fleet, node, now_slot)
    other = fleet.nodes[2]
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: [{"kind": "stray_process", "gpu": 0}],
                                            other.hostname: [{"kind": "stray_process", "gpu": 0}]})
    with django_capture_on_commit_callbacks(execute=False):
        ids = health_sweep()
    idle = {job["host"]: job["idle"] for job in jobs_for(ids)}
    assert idle[node.hostname] is False and idle[other.hostname] is True
    from provisioning.health.services import dispatch

    with django_capture_on_commit_callbacks(execute=True):
        dispatch(ids)
    held_check = HealthCheck.objects.get(node=node)
    assert held_check.verdict == "pass", held_check.summary
    assert not Repair.objects.filter(node=node).exists()
    # On an idle node that nobody holds, the same processes are still a finding.
    assert HealthCheck.objects.get(node=other).verdict == "fail"


@pytest.mark.django_db
def test_a_stray_process_failure_tells_the_team_booked_next_no_pid_or_process_name(
        fleet, settings, eager, now_slot, captured_events, django_capture_on_commit_callbacks):
    """An idle node's sweep finds a process left behind (another team's, say the one booked before). The node
    is drained and the team booked on it later is told (node.failed, health_check.failed): those notices, and
    the node's reason the team reads in the node list, carried the process ids ("pids [4242]"), and an older
    agent's XID line its process name. A team never sees another team's processes: they are counted."""
    from notifications.selectors import notices_for
    from notifications.slack import build_message

    node = fleet.nodes[0]
    later = fleet.book("beta", [node.hostname], now_slot + timedelta(hours=3), now_slot + timedelta(hours=5))
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: [
        {"kind": "stray_process", "gpu": 0, "pid": 4242, "used_mib": 31337},
        {"kind": "stray_process", "gpu": 1, "pid": 5353},
    ]})
    [check] = _run(django_capture_on_commit_callbacks, nodes=[node], level="quick", trigger="schedule")
    check.refresh_from_db()
    assert check.verdict == "fail" and "compute_processes" in check.summary
    # Staff's view of the check keeps the processes (the report's readings).
    readings = json.dumps(check.gpu_results)
    assert "4242" in readings and "5353" in readings
    told = [(name, p) for name, p in captured_events if name in ("node.failed", "health_check.failed")]
    assert {name for name, _ in told} == {"node.failed", "health_check.failed"}
    tenant_notices = [n for name, p in told for n in notices_for(name, p) if n.tenant_id is not None]
    assert {n.tenant_id for n in tenant_notices} == {later.tenant_id}
    for notice in tenant_notices:
        text = json.dumps(notice.payload) + json.dumps(build_message(notice.event, notice.payload,
                                                                     "https://portal.example"))
        assert "4242" not in text and "5353" not in text and "31337" not in text, text
        assert "stray compute process" in text  # what failed is still said, counted
    for _, payload in told:  # the events themselves (webhooks, logs) carry none either
        assert "4242" not in json.dumps(payload) and "5353" not in json.dumps(payload)
    assert "4242" not in Node.objects.get(pk=node.pk).state_reason


@pytest.mark.django_db
def test_an_older_agents_pids_and_process_names_stay_out_of_what_a_team_is_told(
        fleet, captured_events, django_capture_on_commit_callbacks, tomorrow):
    """An agent from before the reports counted processes names them in its messages ("pids [...]", an XID
    line's "pid=…, name=…"): the portal leaves them out of the summary, the node's reason and the events."""
    from provisioning.health.services import health_check_record

    node = fleet.nodes[0]
    fleet.book("beta", [node.hostname], tomorrow, tomorrow + timedelta(hours=2))
    check = HealthCheck.objects.create(node=node, level="quick", trigger="schedule", status="running")
    report = {"verdict": "fail", "recommended_action": "drain_and_reset", "gpus": [], "problems": [
        {"gpu": 0, "check": "compute_processes", "status": "fail", "action": "drain_and_reset",
         "message": "2 stray compute processes on an idle GPU: pids [4242, 5353]"},
        {"gpu": 1, "check": "xid", "status": "fail", "action": "drain_and_reset",
         "message": "XID 13 (Graphics Engine Exception): NVRM: Xid (PCI:0000:18:00): 13, pid=6464, "
                    "name=secret_train.py, Graphics SM Warp Exception"},
    ]}
    with django_capture_on_commit_callbacks(execute=True):
        check = health_check_record(check.pk, report)
    text = check.summary + Node.objects.get(pk=node.pk).state_reason + json.dumps(
        [p for name, p in captured_events if name in ("node.failed", "health_check.failed")])
    assert "stray compute process" in text and "Graphics SM Warp Exception" in text
    for secret in ("4242", "5353", "6464", "secret_train"):
        assert secret not in text, text


@pytest.mark.django_db
def test_node_failed_says_the_state_the_failure_left_the_node_in(
        fleet, settings, eager, now_slot, captured_events, django_capture_on_commit_callbacks):
    """node.failed always said state=draining, also for a node the failure left in maintenance (held after a
    failed teardown: not drained, the repair keeps it out). It says the node's state after the handling."""
    held, available = fleet.nodes[1], fleet.nodes[2]
    _held_after_a_failed_teardown(fleet, held, now_slot)
    settings.PORTAL_FAKE_NVML = fleet_spec({held.hostname: ECC, available.hostname: ECC})
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()
    said = {p["node"]: p["state"] for name, p in captured_events if name == "node.failed"}
    assert said == {held.hostname: "maintenance", available.hostname: "draining"}
    assert {n.hostname: n.state for n in Node.objects.filter(pk__in=[held.pk, available.pk])} == said


@pytest.mark.django_db
def test_the_retest_of_a_repair_a_failing_cuda_support_check_opened_requires_that_cuda_version(
        fleet, settings, eager, tmp_path, tomorrow, django_capture_on_commit_callbacks):
    """A gate check failed the node because its driver supports only CUDA 12.2 and the team chose 12.4. The
    repair's re-test carried no CUDA version, so the node passed it and rejoined whether or not its driver was
    upgraded, and failed the next cluster needing 12.4 again. The re-test now requires the version that failed
    it: a driver that was not upgraded fails it and the node stays out; an upgraded one passes and rejoins."""
    from provisioning.health.services import jobs_for
    from provisioning.services import RetryLater

    cb = django_capture_on_commit_callbacks
    staff = fleet.users["staff"]
    victim = fleet.node("gpu-001")
    spec = tmp_path / "fleet.json"
    spec.write_text(fleet_spec({victim.hostname: [{"kind": "cuda_mismatch"}]}))  # the driver supports 12.2
    settings.PORTAL_FAKE_NVML = f"@{spec}"
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = gate_cluster(booking, "12.4")
    from provisioning.health.services import health_acceptance_gate

    with cb(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    repair = Repair.objects.get(node=victim)
    assert "cuda_support" in repair.triggering_check.summary
    for to in ("accepted", "cordoned", "remediating"):
        repair = _step(cb, repair, to, staff, "driver upgrade")
    # The "remediation" did not upgrade the driver: it still supports only 12.2.
    spec.write_text(fleet_spec({victim.hostname: [{"kind": "cuda_mismatch"}]}))
    later = time.time() + 5
    os.utime(spec, (later, later))
    repair = repair_advance(actor=staff, repair=repair, to="retesting")
    assert jobs_for([repair.retest_check_id])[0]["cuda_min"] == "12.4"
    with cb(execute=True):
        from provisioning.health.services import dispatch

        dispatch([repair.retest_check_id])
    repair.refresh_from_db()
    retest = repair.retest_check
    assert retest.verdict == "fail" and "cuda_support: driver supports CUDA 12.2; CUDA 12.4 is required" in (
        retest.summary)
    assert "this cluster" not in retest.summary  # the node is in repair, out of every cluster
    assert repair.state == "remediating"  # back to remediation: it cannot rejoin
    with pytest.raises(InvalidState):
        repair_advance(actor=staff, repair=repair, to="rejoined")
    assert Node.objects.get(pk=victim.pk).state == "maintenance"
    # Upgraded for real this time: the re-test passes and the node rejoins.
    repair = _fixed_and_retested(cb, repair, spec, staff)
    assert jobs_for([repair.retest_check_id]) == []  # done; it was sent with the version required
    _step(cb, repair, "rejoined", staff)
    assert Node.objects.get(pk=victim.pk).state == "available"
