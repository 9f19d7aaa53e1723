"""The acceptance gate: a cluster's nodes are handed over only when they pass a medium check."""

from __future__ import annotations

from datetime import timedelta

import pytest

from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import acceptance_verdict, health_acceptance_gate
from reservations.models import Allocation

from .conftest import fleet_spec

ECC = [{"kind": "ecc_uncorrected", "gpu": 5}]


def _node_ids(reservation):
    return list(Allocation.objects.filter(reservation=reservation, active=True).values_list("node_id", flat=True))


def _verdict(callbacks, node_ids, reservation):
    with callbacks(execute=True):
        return acceptance_verdict(node_ids, level="medium", reservation_id=reservation.pk)


@pytest.mark.django_db
def test_healthy_nodes_pass_after_their_checks_ran(fleet, settings, eager, tomorrow,
                                                   django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec()
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    nodes = _node_ids(booking)
    # First call: nothing recorded yet, so medium checks are queued (and run, eagerly, on commit).
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert (passed, summary["state"]) == (False, "pending")
    assert summary["nodes"] == {"gpu-001": "queued", "gpu-002": "queued"}
    checks = HealthCheck.objects.filter(pk__in=summary["check_ids"])
    assert {(c.level, c.trigger, c.reservation_id, c.verdict) for c in checks} == {
        ("medium", "acceptance", booking.pk, "pass")}
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert passed and summary["state"] == "passed"
    assert summary["nodes"] == {"gpu-001": "pass", "gpu-002": "pass"}
    assert HealthCheck.objects.count() == 2  # the results are reused, not run again


@pytest.mark.django_db
def test_a_failing_node_holds_the_cluster_back_and_is_swapped(fleet, settings, eager, tomorrow,
                                                               django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-002": ECC})
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    nodes = _node_ids(booking)
    _verdict(django_capture_on_commit_callbacks, nodes, booking)
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert not passed and summary["state"] == "failed"
    assert summary["nodes"]["gpu-002"] == "fail" and "gpu-002 (fail)" in summary["detail"]
    # The failing node was drained, a repair opened, and the booking moved to a spare.
    assert fleet.node("gpu-002").state == "draining"
    assert Repair.objects.get(node__hostname="gpu-002").triggering_check.trigger == "acceptance"
    current = _node_ids(booking)
    assert len(current) == 2 and fleet.node("gpu-002").pk not in current
    # The gate asks about the nodes the booking holds now: the spare is checked, then all pass.
    passed, summary = _verdict(django_capture_on_commit_callbacks, current, booking)
    assert summary["state"] == "pending"
    passed, summary = _verdict(django_capture_on_commit_callbacks, current, booking)
    assert passed, summary


@pytest.mark.django_db
def test_node_still_serving_another_booking_gets_a_quick_check(fleet, settings, eager, now_slot,
                                                              django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec()
    end = now_slot + timedelta(hours=2)
    fleet.book("beta", ["gpu-003"], now_slot, end)  # beta's jobs run on gpu-003 until `end`
    booking = fleet.book("alpha", ["gpu-003", "gpu-004"], end, end + timedelta(hours=3), "provisioning")
    passed, summary = _verdict(django_capture_on_commit_callbacks, _node_ids(booking), booking)
    levels = dict(HealthCheck.objects.filter(pk__in=summary["check_ids"]).values_list("node__hostname", "level"))
    assert levels == {"gpu-003": "quick", "gpu-004": "medium"}
    passed, summary = _verdict(django_capture_on_commit_callbacks, _node_ids(booking), booking)
    assert passed


@pytest.mark.django_db
def test_unknown_results_fail_then_run_again(fleet, settings, eager, tomorrow, django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "init_failure", "error": "NoPermission"}]})
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 0
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    nodes = _node_ids(booking)
    _verdict(django_capture_on_commit_callbacks, nodes, booking)
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 3600
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert not passed and summary["nodes"] == {"gpu-001": "unknown"}  # never a silent pass
    assert fleet.node("gpu-001").state == "available"  # unknown is not a failure: no drain
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 0
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert summary["state"] == "pending" and HealthCheck.objects.count() == 2


@pytest.mark.django_db
def test_gate_waits_while_checks_run_then_answers(fleet, settings, eager, tomorrow,
                                                  django_capture_on_commit_callbacks):
    from provisioning.models import VirtualCluster
    from provisioning.services import GateResult, RetryLater

    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": ECC})
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = VirtualCluster.objects.create(
        reservation=booking, tenant=booking.tenant, status="running_acceptance_tests", backend="simulated",
        orchestrator="slurm", orchestrator_version="24.11", cuda_version="12.8", default_memory_per_gpu_gib=80,
        shared_storage_gib=100,
    )
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    # gpu-001 failed and was swapped for a spare; the gate now checks the spare.
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    result = health_acceptance_gate(cluster=cluster)
    assert isinstance(result, GateResult) and result.passed
    assert list(result.nodes.values()) == ["pass"] and "gpu-001" not in result.nodes
