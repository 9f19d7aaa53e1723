"""Every injectable fault, end to end through the database.

A simulated node with the fault (PORTAL_FAKE_NVML, as in the demo) is checked through the
services and Celery; the stored check carries the library's verdict and action, and a failing
node is drained, gets a repair naming the check, and its booking moves to a spare (even rows)
or degrades its reservation (odd rows, no spare in service).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from provisioning.health.checks import format_cuda_version
from provisioning.health.choices import CheckStatus
from provisioning.health.fake_nvml import DEFAULT_CUDA, DEFAULT_DRIVER
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import health_checks_request
from reservations.models import Allocation, Node
from tests.health.test_fault_matrix import CASES, TARGET, Case

from .conftest import fleet_spec, make_fleet

ROWS = list(enumerate(CASES))


@pytest.mark.django_db
@pytest.mark.parametrize(("row", "case"), ROWS, ids=[f"{i:02d}-{c.id}" for i, c in ROWS])
def test_fault_is_stored_and_acted_on(row: int, case: Case, settings, eager, tomorrow, captured_events,
                                      django_capture_on_commit_callbacks) -> None:
    fleet = make_fleet(nodes=3, model=case.model, users=False)
    victim, spare, other = fleet.nodes
    with_spare = row % 2 == 0
    if not with_spare:
        Node.objects.filter(pk=spare.pk).update(state="maintenance")
    reservation = fleet.book("alpha", [victim.hostname], tomorrow, tomorrow + timedelta(hours=4), status="confirmed")
    fleet.book("beta", [other.hostname], tomorrow, tomorrow + timedelta(hours=4), status="confirmed")
    settings.PORTAL_FAKE_NVML = fleet_spec({victim.hostname: {"faults": [case.fault.to_dict()], "seed": 11}})
    settings.PORTAL_HEALTH_DRIVER_PIN, settings.PORTAL_HEALTH_CUDA_PIN = (
        DEFAULT_DRIVER, format_cuda_version(DEFAULT_CUDA))
    for key, value in case.options:
        assert key == "nvml_timeout_s"
        settings.PORTAL_HEALTH_NVML_TIMEOUT = value

    with django_capture_on_commit_callbacks(execute=True):
        [check] = health_checks_request(nodes=[victim], level="quick", trigger="schedule")

    check = HealthCheck.objects.get(pk=check.pk)
    assert check.status == CheckStatus.DONE
    assert check.verdict == case.node_verdict, check.summary
    assert check.recommended_action == case.action
    assert check.started_at and check.finished_at and check.handled_at
    if case.node_verdict != "pass":
        where = TARGET if case.on_gpu else None
        assert (where, case.check) in {(p["gpu"], p["check"]) for p in check.problems}
    if case.gpu_verdict is not None and not case.every_gpu:
        assert check.gpu_results[TARGET]["verdict"] == case.gpu_verdict
    victim.refresh_from_db()
    names = [name for name, _ in captured_events]

    if case.node_verdict == "fail":
        assert victim.state == "draining" and f"#{check.pk}" in victim.state_reason
        repair = Repair.objects.get(node=victim)
        assert (repair.state, repair.triggering_check_id, repair.recommended_action) == (
            "recommended", check.pk, case.action)
        assert not Allocation.objects.filter(node=victim, active=True).exists()
        reservation.refresh_from_db()
        [outcome] = repair.outcomes
        if with_spare:
            assert outcome["result"] == "replaced" and outcome["spare"] == spare.hostname
            assert Allocation.objects.filter(reservation=reservation, node=spare, active=True).exists()
            assert reservation.missing_nodes == 0 and "node.replaced" in names
        else:
            assert outcome["result"] == "degraded" and reservation.missing_nodes == 1
            assert "reservation.degraded" in names
        failed = dict(captured_events)["health_check.failed"]
        assert failed["node"] == victim.hostname and failed["verdict"] == "fail"
        assert failed["tenant_ids"] == [fleet.tenants["alpha"].pk]
        assert any(p["check"] == case.check for p in failed["problems"])
        node_failed = dict(captured_events)["node.failed"]
        assert (node_failed["repair_id"], node_failed["check_id"]) == (repair.pk, check.pk)
        # The failing report keeps every reading, passing ones included.
        if check.gpu_results:
            assert any(c["status"] == "pass" for g in check.gpu_results for c in g["checks"])
    else:
        assert victim.state == "available"
        assert not Repair.objects.exists()
        assert Allocation.objects.get(node=victim).active
        assert "health_check.failed" not in names and "node.failed" not in names
        # Scheduled checks keep passing readings as names only.
        assert all(c["status"] != "pass" for g in check.gpu_results for c in g["checks"])
