"""The health tasks run twice, one after the other and at once (real threads, real PostgreSQL), act once.

Celery redelivers a message whose worker died, and record_report retries after a database error: every task
here may run again, or beside a copy of itself.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from provisioning.health import services, tasks
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.runner import SimulatedFleet
from tests.racing import in_turn

FAILING = [{"kind": "remap_failure", "gpu": 4}]


def _failing_report(check: HealthCheck) -> dict:
    fake = SimulatedFleet({"nodes": {check.node.hostname: FAILING}})
    report = fake.run({"id": check.pk, "host": check.node.hostname, "level": check.level, "model": "H100-SXM",
                       "gpus": 8})
    assert report["verdict"] == "fail"
    return report


@pytest.fixture
def emitted(monkeypatch) -> list[str]:
    """The events the health services emit (node.failed, health_check.failed), in order, from any thread."""
    seen: list[str] = []
    emit = services.events.emit

    def keep(event, **payload):
        seen.append(event)
        return emit(event, **payload)

    monkeypatch.setattr(services.events, "emit", keep)
    return seen


@pytest.fixture
def sent(monkeypatch) -> list[list[int]]:
    """The checks each sweep sends (instead of the broker)."""
    batches: list[list[int]] = []
    monkeypatch.setattr(services, "dispatch", lambda ids: batches.append(sorted(ids)) or len(ids))
    return batches


def _lock_check(check_id: int):
    def hold() -> None:
        list(HealthCheck.objects.select_for_update().filter(pk=check_id))
    return hold


@pytest.mark.django_db(transaction=True)
def test_record_report_twice_at_once_opens_one_repair_and_tells_once(fleet, emitted):
    node = fleet.nodes[0]
    check = HealthCheck.objects.create(node=node, level="quick", trigger="schedule", status="running")
    report = _failing_report(check)

    # Both copies meet the check's row held by a third transaction, then go on together.
    results = in_turn(_lock_check(check.pk), [lambda: tasks.record_report(check.pk, report)] * 2,
                      waits_on="health_healthcheck")
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sorted(r["recorded"] for r in results) == [0, 1]
    assert Repair.objects.filter(node=node).count() == 1
    assert emitted.count("node.failed") == 1 and emitted.count("health_check.failed") == 1
    node.refresh_from_db()
    assert node.state == "draining"

    # A third, late copy (a redelivery after both finished) changes nothing.
    assert tasks.record_report(check.pk, report) == {"recorded": 0, "handled": 0}
    assert Repair.objects.filter(node=node).count() == 1
    assert emitted.count("node.failed") == 1


@pytest.mark.django_db(transaction=True)
def test_fleet_run_twice_records_each_check_once(fleet, emitted, monkeypatch):
    from .conftest import fleet_spec

    monkeypatch.setenv("PORTAL_FAKE_NVML", fleet_spec({fleet.nodes[0].hostname: FAILING}))
    checks = services.health_checks_request(nodes=fleet.nodes[:2], level="quick", trigger="schedule")
    jobs = services.jobs_for([c.pk for c in checks])

    results = in_turn(_lock_check(checks[0].pk), [lambda: tasks.fleet_run(jobs)] * 2, waits_on="health_healthcheck")
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sum(r["recorded"] for r in results) == 2
    assert Repair.objects.count() == 1 and emitted.count("node.failed") == 1
    finished = HealthCheck.objects.filter(pk__in=[c.pk for c in checks]).values_list("finished_at", flat=True)
    assert tasks.fleet_run(jobs) == {"recorded": 0, "handled": 0}  # the redelivery: nothing open any more
    assert list(HealthCheck.objects.filter(pk__in=[c.pk for c in checks]).values_list("finished_at", flat=True)) \
        == list(finished)
    assert Repair.objects.count() == 1 and emitted.count("node.failed") == 1


@pytest.mark.django_db(transaction=True)
def test_checks_started_twice_starts_each_check_once(fleet):
    checks = services.health_checks_request(nodes=fleet.nodes[:2], level="quick", trigger="schedule")
    ids = [c.pk for c in checks]
    assert tasks.checks_started(ids) == 2
    started = dict(HealthCheck.objects.filter(pk__in=ids).values_list("pk", "started_at"))
    assert tasks.checks_started(ids) == 0
    assert dict(HealthCheck.objects.filter(pk__in=ids).values_list("pk", "started_at")) == started


@pytest.mark.django_db(transaction=True)
def test_two_sweeps_at_once_queue_and_send_each_node_once(fleet, sent):
    def hold():
        # A sweep in flight: its checks inserted, not yet committed; the two others meet them on the unique index.
        services.health_sweep()

    results = in_turn(hold, [tasks.sweep] * 2, waits_on="health_healthcheck")
    assert results == [0, 0]
    assert HealthCheck.objects.filter(trigger="schedule").count() == len(fleet.nodes)
    assert [len(batch) for batch in sent] == [len(fleet.nodes)]  # only the holder's sweep sent any
    assert tasks.sweep() == 0 and len(sent) == 1  # and a later one, while they are open, neither


@pytest.mark.django_db(transaction=True)
def test_maintain_twice_at_once_expires_and_handles_each_check_once(fleet, emitted):
    now = timezone.now()
    old = now - timedelta(hours=2)
    # One check no agent answered, one failing report whose consequences a killed worker never applied.
    [silent] = services.health_checks_request(nodes=[fleet.nodes[0]], level="quick", trigger="schedule")
    HealthCheck.objects.filter(pk=silent.pk).update(created_at=old)
    crashed = HealthCheck.objects.create(node=fleet.nodes[1], level="quick", trigger="schedule", status="running")
    report = _failing_report(crashed)
    real_handle = services.health_check_handle
    services.health_check_handle = lambda check_id: None  # the worker died right after storing the report
    try:
        services.health_checks_record([(crashed.pk, report)])
    finally:
        services.health_check_handle = real_handle
    HealthCheck.objects.filter(pk=crashed.pk).update(finished_at=old)
    assert HealthCheck.objects.get(pk=crashed.pk).handled_at is None

    def hold():
        # The node's health lock, as a recording in flight holds it: both copies reach it and wait.
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", [services.LOCK_NODE_HEALTH, fleet.nodes[1].pk])

    results = in_turn(hold, [tasks.maintain] * 2)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sum(r["expired"] for r in results) == 1
    assert Repair.objects.filter(node=fleet.nodes[1]).count() == 1
    assert emitted.count("node.failed") == 1 and emitted.count("health_check.failed") == 1
    assert HealthCheck.objects.get(pk=silent.pk).verdict == "unknown"

    again = tasks.maintain()
    assert (again["expired"], again["handled"]) == (0, 0)
    assert Repair.objects.count() == 1 and emitted.count("node.failed") == 1
