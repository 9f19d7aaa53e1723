"""Sweeps, expiry, pruning, malformed reports, and the beat entries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from provisioning.health import schedule
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import (
    dispatch,
    health_check_record,
    health_checks_expire,
    health_checks_prune,
    health_checks_request,
    health_maintain,
    health_sweep,
    jobs_for,
    repair_advance,
)
from reservations.models import Node

from .conftest import fleet_spec


@pytest.mark.django_db
def test_sweep_queues_nodes_in_service_once(fleet):
    Node.objects.filter(hostname="gpu-004").update(state="failed")
    Node.objects.filter(hostname="gpu-003").update(state="maintenance")
    ids = health_sweep()
    assert sorted(HealthCheck.objects.filter(pk__in=ids).values_list("node__hostname", flat=True)) == [
        "gpu-001", "gpu-002", "gpu-003"]
    assert health_sweep() == []  # open checks are not doubled
    # Another level, or a tenant's booking, is another open check.
    assert len(health_sweep(level="medium")) == 3


@pytest.mark.django_db
def test_jobs_say_whether_a_node_is_busy_and_who_it_runs_with(fleet, now_slot, settings):
    settings.PORTAL_HEALTH_DRIVER_PIN = "550.90.07"
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], now_slot, now_slot + timedelta(hours=2))
    checks = health_checks_request(nodes=fleet.nodes[:3], level="full", trigger="tenant", reservation=booking)
    jobs = {job["host"]: job for job in jobs_for([c.pk for c in checks])}
    assert jobs["gpu-001"]["idle"] is False and jobs["gpu-003"]["idle"] is True
    assert jobs["gpu-001"]["peers"] == ["gpu-002"] and jobs["gpu-001"]["detail"] == "full"
    assert jobs["gpu-001"]["pins"] == {"driver": "550.90.07"}
    assert (jobs["gpu-001"]["model"], jobs["gpu-001"]["gpus"], jobs["gpu-001"]["heal"]) == ("H100-SXM", 8, None)


@pytest.mark.django_db
def test_unanswered_checks_expire_as_unknown(fleet, settings):
    checks = health_checks_request(nodes=fleet.nodes[:2], level="quick", trigger="schedule")
    HealthCheck.objects.filter(pk=checks[0].pk).update(created_at=timezone.now() - timedelta(minutes=10))
    assert health_checks_expire() == [checks[0].pk]
    expired = HealthCheck.objects.get(pk=checks[0].pk)
    assert (expired.status, expired.verdict, expired.handled_at is not None) == ("error", "unknown", True)
    assert "no report" in expired.error
    assert HealthCheck.objects.get(pk=checks[1].pk).status == "queued"
    # A late report for an expired check changes nothing.
    health_check_record(checks[0].pk, {"verdict": "fail", "problems": [], "gpus": []})
    assert HealthCheck.objects.get(pk=checks[0].pk).verdict == "unknown"
    assert Node.objects.get(pk=checks[0].node_id).state == "available"


@pytest.mark.django_db
def test_an_expired_retest_sends_the_repair_back(fleet, django_capture_on_commit_callbacks):
    from provisioning.health.services import repair_open

    staff = fleet.users["staff"]
    repair = repair_open(actor=staff, node=fleet.nodes[0], reason="manual")
    for to in ("accepted", "cordoned", "remediating", "retesting"):
        repair = repair_advance(actor=staff, repair=repair, to=to)
    HealthCheck.objects.filter(pk=repair.retest_check_id).update(created_at=timezone.now() - timedelta(hours=2))
    health_maintain()
    repair.refresh_from_db()
    assert repair.state == "remediating" and "unknown" in repair.steps[-1]["note"]


@pytest.mark.django_db
@pytest.mark.parametrize("report", [None, "fail", {"verdict": "great"}, {"verdict": "pass", "gpus": "x"},
                                    {"verdict": "pass", "problems": [], "gpus": [], "junk": "x" * 2_100_000}])
def test_malformed_reports_are_unknown_never_pass(report, fleet):
    [check] = health_checks_request(nodes=[fleet.nodes[0]], level="quick", trigger="schedule")
    check = health_check_record(check.pk, report)
    assert check.status == "done"
    if isinstance(report, dict) and report.get("verdict") == "pass" and "junk" not in report:
        assert check.verdict == "pass" and check.gpu_results == []
    else:
        assert check.verdict == "unknown" and check.summary
    assert check.node.state == "available"


@pytest.mark.django_db
def test_prune_keeps_each_nodes_latest_and_repair_evidence(fleet, eager, settings,
                                                           django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-002": [{"kind": "remap_pending", "gpu": 0}]})
    for _ in range(3):
        with django_capture_on_commit_callbacks(execute=True):
            health_sweep()
    old = timezone.now() - timedelta(days=30)
    HealthCheck.objects.update(created_at=old)
    repair = Repair.objects.get()
    # gpu-001, 003, 004 lose their two older checks; gpu-002 keeps its newest and the repair's evidence.
    assert health_checks_prune() == 7
    left = HealthCheck.objects.all()
    assert left.count() == 5
    assert left.filter(pk=repair.triggering_check_id).exists()
    assert set(left.values_list("node__hostname", flat=True)) == {"gpu-001", "gpu-002", "gpu-003", "gpu-004"}


@pytest.mark.django_db
def test_dispatch_without_a_broker_leaves_checks_to_expire(fleet, monkeypatch):
    from celery import current_app

    checks = health_checks_request(nodes=[fleet.nodes[0]], level="quick", trigger="schedule")
    # Point the app at a port nothing listens on, with fresh connection pools (restored after). Celery
    # reads CELERY_BROKER_URL from the environment before its configuration: unset it meanwhile.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    amqp = current_app.amqp
    saved = current_app._pool, amqp._producer_pool, current_app.conf.broker_url
    current_app._pool, amqp._producer_pool, current_app.conf.broker_url = None, None, "redis://127.0.0.1:1/0"
    try:
        assert dispatch([checks[0].pk]) == 0
    finally:
        if current_app._pool is not None:
            current_app._pool.force_close_all()
        current_app._pool, amqp._producer_pool, current_app.conf.broker_url = saved
    assert HealthCheck.objects.get(pk=checks[0].pk).status == "queued"


def test_beat_entries_name_real_tasks():
    from provisioning.health import tasks

    names = {tasks.sweep.name, tasks.maintain.name}
    assert {entry["task"] for entry in schedule.BEAT.values()} == names


@pytest.mark.django_db
def test_a_broken_fault_spec_gives_unknown_reports(fleet, settings, eager, django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = "{not json"
    with django_capture_on_commit_callbacks(execute=True):
        checks = health_checks_request(nodes=fleet.nodes[:2], level="quick", trigger="schedule")
    for check in HealthCheck.objects.filter(pk__in=[c.pk for c in checks]):
        assert (check.status, check.verdict) == ("done", "unknown") and "agent error" in check.summary


def test_worker_entry_point_serves_the_right_queue(monkeypatch):
    from provisioning.health.worker import build_argv

    monkeypatch.delenv("PORTAL_HEALTH_FLEET_QUEUE", raising=False)
    fleet = build_argv(["fleet", "-c", "3"])
    assert fleet[fleet.index("-Q") + 1] == "fleet" and fleet[fleet.index("-c") + 1] == "3"
    node = build_argv(["node", "--hostname", "h100-sxm-007", "--max-tasks-per-child", "50"])
    assert node[node.index("-Q") + 1] == "node.h100-sxm-007" and node[node.index("-c") + 1] == "1"
    assert node[-2:] == ["--max-tasks-per-child", "50"]


@pytest.mark.django_db
@pytest.mark.parametrize("report", [
    {"verdict": "fail", "problems": ["disk on fire", 7]},
    {"verdict": "warn", "problems": [{"gpu": [0], "check": {}, "status": ["warn"], "message": None}]},
    {"verdict": "pass", "gpus": ["x", 3, None]},
    {"verdict": "warn", "gpus": [{"index": 0, "verdict": {"worst": "fail"}, "action": ["reseat"], "checks": 5,
                                  "passed": 3},
                                 {"index": "1", "checks": [7, {"name": "temperature", "status": "warn"}],
                                  "passed": [None, "power"]}]},
])
def test_malformed_entries_in_a_report_are_stored_and_shown_without_an_error(report, fleet):
    """A report whose problems or GPUs are not objects crashed the recording (AttributeError/TypeError:
    the check stayed running until it expired) or, stored, made every health-check list and the check's
    page a 500 for staff and the tenant holding the node."""
    [check] = health_checks_request(nodes=[fleet.nodes[0]], level="quick", trigger="schedule")
    check = health_check_record(check.pk, report)
    assert check.status == "done" and check.verdict == report["verdict"]
    assert all(isinstance(p, dict) for p in check.problems)
    assert all(isinstance(g, dict) for g in check.gpu_results)
    api = fleet.client("staff")
    assert api.get("/api/v1/health-checks/").status_code == 200
    assert api.get(f"/api/v1/health-checks/{check.pk}/").status_code == 200
    from django.test import Client

    browser = Client()
    browser.force_login(fleet.users["staff"])
    for url in (f"/health/checks/{check.pk}/", f"/health/nodes/{check.node.hostname}/", "/health/"):
        assert browser.get(url).status_code == 200, url


@pytest.mark.django_db
def test_the_sweep_records_a_failing_node_in_staff_maintenance_without_opening_a_repair(
        fleet, settings, eager, captured_events, django_capture_on_commit_callbacks):
    """Staff put a node in maintenance to work on it by hand; the sweep checked it, the check failed (the
    node is mid-work), a repair opened, and that repair then refused staff's own return of the node to
    available. The sweep's result is kept (staff read it on the node's page) but opens no repair."""
    from reservations.services import node_update

    staff = fleet.users["staff"]
    node = fleet.nodes[1]
    node_update(actor=staff, node=node, state="maintenance", reason="PSU swap")
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: [{"kind": "ecc_uncorrected", "gpu": 2}]})
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()
    check = HealthCheck.objects.get(node=node)
    assert (check.status, check.verdict, check.handled_at is not None) == ("done", "fail", True)
    assert not Repair.objects.filter(node=node).exists()
    node.refresh_from_db()
    assert (node.state, node.state_reason) == ("maintenance", "PSU swap")
    # Staff working on the node are told (health_check.failed, the platform channel's), nothing is drained.
    assert [name for name, p in captured_events if name in ("node.failed", "health_check.failed")] == [
        "health_check.failed"]
    # Staff finish their work and give the node back.
    node = node_update(actor=staff, node=Node.objects.get(pk=node.pk), state="available", reason="")
    assert node.state == "available"
    # Back in service, the next sweep's failure takes it out as usual.
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()
    assert Repair.objects.filter(node=node, state="recommended").exists()
    assert Node.objects.get(pk=node.pk).state == "draining"


def _maintenance_notices(captured_events) -> list[dict]:
    return [p for name, p in captured_events if name in ("node.failed", "health_check.failed")]


@pytest.mark.django_db
def test_a_failing_sweep_of_a_node_in_staff_maintenance_tells_staff_once_per_failure_and_period(
        fleet, settings, eager, captured_events, django_capture_on_commit_callbacks):
    """The sweep's failing check of a node staff put in maintenance opens no repair, but staff still hear of
    it (health_check.failed, which the platform channel gets): once per maintenance period, and again when
    the failure changes, not at every sweep of a node that is still failing the same way."""
    from notifications.selectors import notices_for
    from reservations.services import node_update

    staff = fleet.users["staff"]
    node = fleet.nodes[1]
    node = node_update(actor=staff, node=node, state="maintenance", reason="PSU swap")

    def sweep(faults):
        settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: faults})
        captured_events.clear()
        with django_capture_on_commit_callbacks(execute=True):
            health_sweep()
        return _maintenance_notices(captured_events)

    first = sweep([{"kind": "ecc_uncorrected", "gpu": 2}])
    assert [(p["node"], p["trigger"], p["verdict"]) for p in first] == [(node.hostname, "schedule", "fail")]
    assert {p["gpu"] for p in first[0]["problems"]} == {2}
    platform = [n for n in notices_for("health_check.failed", first[0]) if n.to_platform]
    assert [n.payload["node"] for n in platform] == [node.hostname]
    assert sweep([{"kind": "ecc_uncorrected", "gpu": 2}]) == []  # still failing the same way: said already
    changed = sweep([{"kind": "ecc_uncorrected", "gpu": 2}, {"kind": "ecc_uncorrected", "gpu": 5}])
    assert [{p["gpu"] for p in n["problems"]} for n in changed] == [{2, 5}]
    assert sweep([{"kind": "ecc_uncorrected", "gpu": 2}, {"kind": "ecc_uncorrected", "gpu": 5}]) == []
    assert not Repair.objects.filter(node=node).exists()
    # Staff give the node back and put it in maintenance again before the next sweep: a new period, told again.
    node = node_update(actor=staff, node=Node.objects.get(pk=node.pk), state="available", reason="")
    node = node_update(actor=staff, node=Node.objects.get(pk=node.pk), state="maintenance", reason="cabling")
    again = sweep([{"kind": "ecc_uncorrected", "gpu": 2}, {"kind": "ecc_uncorrected", "gpu": 5}])
    assert [(p["node"], p["verdict"]) for p in again] == [(node.hostname, "fail")]
    # A pass in between: the failure coming back is news again.
    assert sweep([]) == []
    back = sweep([{"kind": "ecc_uncorrected", "gpu": 2}, {"kind": "ecc_uncorrected", "gpu": 5}])
    assert [(p["node"], p["verdict"]) for p in back] == [(node.hostname, "fail")]
    assert not Repair.objects.filter(node=node).exists()
    assert Node.objects.get(pk=node.pk).state == "maintenance"


@pytest.mark.django_db
def test_a_failing_sweep_during_a_maintenance_window_is_staff_work_not_a_repair(
        fleet, settings, eager, now_slot, captured_events, django_capture_on_commit_callbacks):
    """Staff schedule a maintenance window for planned hands-on work (the node stays `available`: the window's
    allocation keeps bookings off it). The sweep checked the node mid-work, the check failed, and the node was
    drained, a repair opened (which then held the node out after the window) and the bookings after the window
    were moved to spares, though maintenance never moves a booking. A window is staff's maintenance too."""
    from reservations.services import maintenance_window_create

    staff = fleet.users["staff"]
    node = fleet.nodes[1]
    window_end = now_slot + timedelta(hours=2)
    maintenance_window_create(actor=staff, node=node, start=now_slot, end=window_end, note="firmware flash")
    later = fleet.book("alpha", [node.hostname], window_end, window_end + timedelta(hours=2))
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: [{"kind": "init_failure", "error": "DriverNotLoaded"}]})
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()
    check = HealthCheck.objects.get(node=node)
    assert (check.verdict, check.handled_at is not None) == ("fail", True)
    assert not Repair.objects.filter(node=node).exists()
    assert Node.objects.get(pk=node.pk).state == "available"
    assert later.allocations.get(active=True).node_id == node.pk  # the booking after the window stays
    [told] = [p for name, p in captured_events if name in ("node.failed", "health_check.failed")]
    from notifications.selectors import notices_for

    # Told to staff (the platform channel), not to the team booked after the window.
    assert [(n.to_platform, n.tenant_id) for n in notices_for("health_check.failed", told)] == [(True, None)]
    captured_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()  # failing the same way: said already
    assert [name for name, _ in captured_events if name in ("node.failed", "health_check.failed")] == []
    assert not Repair.objects.filter(node=node).exists()


@pytest.mark.django_db
def test_a_failing_sweep_outside_any_maintenance_window_still_takes_the_node_out(
        fleet, settings, eager, now_slot, django_capture_on_commit_callbacks):
    from reservations.services import maintenance_window_create

    node = fleet.nodes[1]
    maintenance_window_create(actor=fleet.users["staff"], node=node, start=now_slot + timedelta(hours=4),
                              end=now_slot + timedelta(hours=6), note="next week's flash")
    settings.PORTAL_FAKE_NVML = fleet_spec({node.hostname: [{"kind": "ecc_uncorrected", "gpu": 2}]})
    with django_capture_on_commit_callbacks(execute=True):
        health_sweep()
    assert Repair.objects.filter(node=node, state="recommended").exists()
    assert Node.objects.get(pk=node.pk).state == "draining"


def test_an_agent_named_in_capitals_also_serves_the_queue_it_served_before(monkeypatch):
    """An agent on a node whose name has capitals (its socket name, or --hostname) served node.H100-001 before
    the queue names went to lower case; the messages the portal sent there before the upgrade (and what a
    portal not yet upgraded still sends there) must not be left in Redis for ever, unread, the node's checks
    never run. The agent reads both: the lower-case queue first, the one of its name as given."""
    from provisioning.health.worker import build_argv

    node = build_argv(["node", "--hostname", "H100-001"])
    assert node[node.index("-Q") + 1].split(",") == ["node.h100-001", "node.H100-001"]
    monkeypatch.setattr("socket.gethostname", lambda: "GPU-Node-7")
    node = build_argv(["node"])
    assert node[node.index("-Q") + 1].split(",") == ["node.gpu-node-7", "node.GPU-Node-7"]
    # A name in lower case already: one queue.
    node = build_argv(["node", "--hostname", "h100-001"])
    assert node[node.index("-Q") + 1] == "node.h100-001"
