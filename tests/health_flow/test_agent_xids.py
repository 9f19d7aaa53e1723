"""A node agent (provisioning.health.tasks.agent_run, run eagerly here with a fake NVML) counts a kernel-log XID
as reported only once the portal stored the report that carried it."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from provisioning.health import tasks
from provisioning.health.models import HealthCheck
from provisioning.health.services import health_checks_expire, health_checks_request, jobs_for
from provisioning.health.xid import HealthState

XID = {"nodes": {"gpu-001": [{"kind": "xid", "gpu": 3, "xid": 79}]}}


def _check(node):
    [check] = health_checks_request(nodes=[node], level="quick", trigger="staff")
    return check


@pytest.mark.django_db
def test_an_xid_whose_report_the_portal_refused_is_reported_by_the_next_check(fleet, eager, settings, tmp_path,
                                                                                monkeypatch):
    """The agent marked the XID reported when it ran; its report arrived after the check had expired (the
    portal stored nothing), and no later check ever saw the XID: the GPU that fell off the bus passed."""
    monkeypatch.setenv("PORTAL_FAKE_NVML", json.dumps(XID))
    settings.PORTAL_HEALTH_STATE_DIR = str(tmp_path)
    node = fleet.nodes[0]
    state_file = tmp_path / f"health-state-{node.hostname}.json"

    late = _check(node)
    [job] = jobs_for([late.pk])
    HealthCheck.objects.filter(pk=late.pk).update(created_at=timezone.now() - timedelta(hours=1))
    assert health_checks_expire() == [late.pk]
    assert tasks.agent_run(job) == "fail"  # the agent ran late; the portal refuses the report
    late.refresh_from_db()
    assert (late.status, late.verdict) == ("error", "unknown")
    assert HealthState.load(state_file).reported_xids == {}

    second = _check(node)
    [job] = jobs_for([second.pk])
    assert tasks.agent_run(job) == "fail"
    second.refresh_from_db()
    assert second.verdict == "fail" and "xid" in second.summary.lower(), second.summary
    assert len(HealthState.load(state_file).reported_xids) == 1  # the portal stored it: acknowledged

    third = _check(node)
    [job] = jobs_for([third.pk])
    tasks.agent_run(job)
    third.refresh_from_db()
    assert "xid" not in third.summary.lower(), third.summary  # reported once


@pytest.mark.django_db
def test_a_counter_increase_whose_report_the_portal_refused_is_reported_by_the_next_check(
        fleet, eager, settings, tmp_path, monkeypatch):
    """The agent saved its counter readings as the new baseline when it ran; the report carrying three new
    uncorrected ECC errors arrived after its check had expired, and the next check, comparing against that
    baseline, passed the GPU. The readings become the baseline only once the portal stored the report."""
    settings.PORTAL_HEALTH_STATE_DIR = str(tmp_path)
    node = fleet.nodes[0]
    state_file = tmp_path / f"health-state-{node.hostname}.json"

    monkeypatch.setenv("PORTAL_FAKE_NVML", json.dumps({"nodes": {}}))
    first = _check(node)
    [job] = jobs_for([first.pk])
    assert tasks.agent_run(job) == "pass"  # stored and acknowledged: the baseline (no errors)
    assert len(HealthState.load(state_file).counters) == 8

    ecc = {"nodes": {node.hostname: [{"kind": "ecc_uncorrected_aggregate", "gpu": 5, "count": 3}]}}
    monkeypatch.setenv("PORTAL_FAKE_NVML", json.dumps(ecc))
    late = _check(node)
    [job] = jobs_for([late.pk])
    HealthCheck.objects.filter(pk=late.pk).update(created_at=timezone.now() - timedelta(hours=1))
    assert health_checks_expire() == [late.pk]
    assert tasks.agent_run(job) == "fail"  # the portal refuses the report

    second = _check(node)
    [job] = jobs_for([second.pk])
    assert tasks.agent_run(job) == "fail"
    second.refresh_from_db()
    assert second.verdict == "fail" and "ecc_uncorrected_aggregate" in second.summary, second.summary
    state = HealthState.load(state_file)
    assert state.pending_counters == {}  # acknowledged: its readings are the baseline

    third = _check(node)
    [job] = jobs_for([third.pk])
    tasks.agent_run(job)
    third.refresh_from_db()
    assert "ecc_uncorrected_aggregate" not in third.summary, third.summary  # reported once


@pytest.mark.django_db
def test_an_xid_is_acknowledged_when_recording_is_retried_after_the_report_was_stored(
        fleet, eager, settings, tmp_path, monkeypatch):
    """record_report stores the report, then applies its consequences; a database error there (a deadlock, a
    dropped connection) retries the task, which found the check already stored ("recorded": 0) and so never
    acknowledged it: the agent sent the XID again with its next check, which failed the node for it again."""
    from celery.exceptions import Retry
    from django.db import OperationalError

    from provisioning.health import services

    monkeypatch.setenv("PORTAL_FAKE_NVML", json.dumps(XID))
    settings.PORTAL_HEALTH_STATE_DIR = str(tmp_path)
    node = fleet.nodes[0]
    state_file = tmp_path / f"health-state-{node.hostname}.json"
    handle, calls = services.health_check_handle, []

    def flaky_handle(check_id):
        calls.append(check_id)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return handle(check_id)

    monkeypatch.setattr(services, "health_check_handle", flaky_handle)
    sent, send = [], tasks.record_report.apply_async

    def keep(args=None, kwargs=None, **options):
        sent.append((args, kwargs))
        return send(args=args, kwargs=kwargs, **options)

    monkeypatch.setattr(tasks.record_report, "apply_async", keep)
    first = _check(node)
    [job] = jobs_for([first.pk])
    with pytest.raises(Retry):  # record_report stored the report, then failed: Celery retries it
        tasks.agent_run(job)
    [(args, kwargs)] = sent
    tasks.record_report(*args, **kwargs)  # the retry
    first.refresh_from_db()
    assert (first.status, first.verdict) == ("done", "fail")
    assert len(HealthState.load(state_file).reported_xids) == 1  # stored, so acknowledged

    second = _check(node)
    [job] = jobs_for([second.pk])
    tasks.agent_run(job)
    second.refresh_from_db()
    assert "xid" not in second.summary.lower(), second.summary  # reported once


@pytest.mark.django_db
def test_an_acknowledgement_delivered_twice_changes_nothing_the_second_time(fleet, eager, settings, tmp_path,
                                                                            monkeypatch):
    """record_report acknowledges a stored report again when it is retried or redelivered: the agent's second
    xids_accepted finds nothing held under that receipt and leaves its state file as it was."""
    monkeypatch.setenv("PORTAL_FAKE_NVML", json.dumps(XID))
    settings.PORTAL_HEALTH_STATE_DIR = str(tmp_path)
    node = fleet.nodes[0]
    state_file = tmp_path / f"health-state-{node.hostname}.json"
    check = _check(node)
    [job] = jobs_for([check.pk])
    assert tasks.agent_run(job) == "fail"  # eager: recorded, then acknowledged once
    before = state_file.read_bytes()
    assert len(HealthState.load(state_file).reported_xids) == 1

    assert tasks.record_report(check.pk, {"verdict": "fail", "problems": [], "gpus": []}, agent=node.hostname) \
        == {"recorded": 0, "handled": 0}  # a redelivered report: acknowledged again (eager: runs here)
    assert tasks.xids_accepted(node.hostname, check.pk) is False
    assert state_file.read_bytes() == before
