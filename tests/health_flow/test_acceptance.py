"""The acceptance gate: a cluster's nodes are handed over only when they pass a medium check."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import acceptance_verdict, health_acceptance_gate
from reservations.models import Allocation

from .conftest import fleet_spec, gate_cluster

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
def test_a_node_whose_gpus_support_no_power_readings_is_handed_over(fleet, settings, eager, tomorrow,
                                                                    django_capture_on_commit_callbacks):
    """NVML answers NOT_SUPPORTED for power on some boards and modes; that read as `unknown`, so the gate
    re-ran the node's check until its deadline and then failed the cluster, every time: the node could never
    be handed over. DCGM raises nothing for unsupported power; the check now passes saying it was not judged."""
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "power_not_supported"}]})
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    nodes = _node_ids(booking)
    _verdict(django_capture_on_commit_callbacks, nodes, booking)
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert passed and summary["nodes"] == {"gpu-001": "pass"}, summary
    check = HealthCheck.objects.get(node__hostname="gpu-001")
    power = [c for gpu in check.gpu_results for c in gpu["checks"] if c["name"] == "power"]
    assert len(power) == 8 and all(c["status"] == "pass" and "not supported" in c["message"] for c in power)


@pytest.mark.django_db
def test_unknown_results_fail_then_run_again(fleet, settings, eager, tomorrow, django_capture_on_commit_callbacks):
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "init_failure", "error": "NoPermission"}]})
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 0
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    nodes = _node_ids(booking)
    _verdict(django_capture_on_commit_callbacks, nodes, booking)
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 3600
    # Within the gate's deadline (a medium check's timeout since it began checking the node) it waits for
    # the re-run (test_a_fresh_unknown_result_is_waited_for_and_run_again_not_failed); past it, unknown fails.
    HealthCheck.objects.update(created_at=timezone.now() - timedelta(hours=2))
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert not passed and summary["nodes"] == {"gpu-001": "unknown"}  # never a silent pass
    assert fleet.node("gpu-001").state == "available"  # unknown is not a failure: no drain
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 0
    passed, summary = _verdict(django_capture_on_commit_callbacks, nodes, booking)
    assert summary["state"] == "pending" and HealthCheck.objects.count() == 2


@pytest.mark.django_db
def test_gate_waits_while_checks_run_then_answers(fleet, settings, eager, tomorrow,
                                                  django_capture_on_commit_callbacks):
    from provisioning.services import GateResult, RetryLater

    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": ECC})
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = gate_cluster(booking, "12.8")
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    # gpu-001 failed and was swapped for a spare; the gate now checks the spare.
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    result = health_acceptance_gate(cluster=cluster)
    assert isinstance(result, GateResult) and result.passed
    assert list(result.nodes.values()) == ["pass"] and "gpu-001" not in result.nodes


@pytest.mark.django_db(transaction=True)
def test_gate_waits_for_a_failing_nodes_swap_instead_of_failing_thegate_cluster(fleet, tomorrow, eager):
    """The gate read a failing acceptance check as soon as it was stored, before its consequences (drain,
    swap to a spare) ran: while another worker held the node's health lock the cluster failed its
    acceptance attempt (counted against PORTAL_PROVISIONING_MAX_ATTEMPTS) for a node about to leave it."""
    import threading
    import time

    from django.db import connection

    from provisioning.health.runner import SimulatedFleet
    from provisioning.health.services import LOCK_NODE_HEALTH, health_check_record
    from provisioning.services import RetryLater

    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = gate_cluster(booking, "12.8")
    node = fleet.node("gpu-001")
    check = HealthCheck.objects.create(node=node, level="medium", trigger="acceptance", reservation=booking,
                                       status="running")
    report = SimulatedFleet({"nodes": {node.hostname: ECC}}).run(
        {"id": check.pk, "host": node.hostname, "level": "medium", "model": "H100-SXM", "gpus": 8})
    assert report["verdict"] == "fail"

    with connection.cursor() as cur:  # another worker busy with this node (a repair step, another check)
        cur.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_NODE_HEALTH, node.pk])
    errors = []

    def record():
        try:
            health_check_record(check.pk, report)
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    worker = threading.Thread(target=record)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while HealthCheck.objects.get(pk=check.pk).status != "done":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert HealthCheck.objects.get(pk=check.pk).handled_at is None  # the swap is still to come
        with pytest.raises(RetryLater):
            health_acceptance_gate(cluster=cluster)
    finally:
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_NODE_HEALTH, node.pk])
        worker.join(30)
    assert not errors, errors
    assert fleet.node("gpu-001").state == "draining"
    assert node.pk not in _node_ids(booking) and len(_node_ids(booking)) == 1
    # The spare is checked next; the failed node is no longer the gate's business.
    with pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    assert health_acceptance_gate(cluster=cluster).passed


@pytest.mark.django_db
def test_a_fresh_unknown_result_is_waited_for_and_run_again_not_failed(fleet, settings, eager, tomorrow,
                                                                       django_capture_on_commit_callbacks):
    """An acceptance check that just finished unknown (NVML could not start, a tool timed out) failed the
    provisioning attempt at once (counted against PORTAL_PROVISIONING_MAX_ATTEMPTS), though the gate runs
    it again once it is PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS old. The gate now waits for that re-run."""
    from provisioning.services import RetryLater

    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "init_failure", "error": "NoPermission"}]})
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 3600
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = gate_cluster(booking, "12.8")
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)  # queued and run (eagerly): gpu-001 unknown, gpu-002 pass
    assert HealthCheck.objects.get(node__hostname="gpu-001").verdict == "unknown"
    with pytest.raises(RetryLater, match="1 of 2 nodes .gpu-001: unknown, run again"):  # waits, does not fail
        health_acceptance_gate(cluster=cluster)
    assert HealthCheck.objects.count() == 2  # not run again before it is RETRY_SECONDS old
    # Whatever made it unknown is gone when it is run again: the cluster passes.
    settings.PORTAL_FAKE_NVML = fleet_spec()
    settings.PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS = 0
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    result = health_acceptance_gate(cluster=cluster)
    assert result.passed and result.nodes == {"gpu-001": "pass", "gpu-002": "pass"}
    assert HealthCheck.objects.count() == 3


@pytest.mark.django_db
def test_the_gate_job_carries_the_clusters_cuda_version(fleet, tomorrow, now_slot):
    """The agent was never told which CUDA version the team chose, so it could not refuse a node whose driver
    cannot run it. A check of a cluster's nodes now carries the cluster's version; an idle node's sweep none."""
    from provisioning.health.services import health_checks_request, health_sweep, jobs_for

    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    gate_cluster(booking, "12.6")
    gate = health_checks_request(nodes=_node_ids(booking), level="medium", trigger="acceptance", reservation=booking)
    assert {job["host"]: job["cuda_min"] for job in jobs_for([c.pk for c in gate])} == {
        "gpu-001": "12.6", "gpu-002": "12.6"}
    # A tenant's check of its running cluster is of that cluster too.
    running = fleet.book("beta", ["gpu-003"], now_slot, now_slot + timedelta(hours=2))
    gate_cluster(running, "13.0")
    [tenant] = health_checks_request(nodes=_node_ids(running), level="quick", trigger="tenant", reservation=running)
    assert jobs_for([tenant.pk])[0]["cuda_min"] == "13.0"
    # A sweep belongs to no cluster: its jobs require no version, as before.
    assert {job.get("cuda_min") for job in jobs_for(health_sweep())} == {None}


@pytest.mark.django_db
def test_a_node_whose_driver_cannot_run_the_clusters_cuda_fails_the_gate_and_is_swapped(
        fleet, settings, eager, tomorrow, django_capture_on_commit_callbacks):
    from provisioning.services import GateResult, RetryLater

    # gpu-001's driver supports CUDA 12.2 at most; the team chose 12.4. gpu-003 (the spare) is current.
    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "cuda_mismatch"}]})
    booking = fleet.book("alpha", ["gpu-001", "gpu-002"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = gate_cluster(booking, "12.4")
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    failed = HealthCheck.objects.get(node__hostname="gpu-001")
    assert (failed.trigger, failed.verdict, failed.recommended_action) == ("acceptance", "fail", "investigate")
    assert "cuda_support: driver supports CUDA 12.2; CUDA 12.4 is required" in failed.summary
    # The same path as any failing gate check: drained, a repair opened, the booking moved to a spare.
    assert fleet.node("gpu-001").state == "draining"
    repair = Repair.objects.get(node__hostname="gpu-001")
    assert repair.triggering_check_id == failed.pk
    assert fleet.node("gpu-001").pk not in _node_ids(booking) and len(_node_ids(booking)) == 2
    assert HealthCheck.objects.get(node__hostname="gpu-002").verdict == "pass"
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)  # the spare is checked
    result = health_acceptance_gate(cluster=cluster)
    assert isinstance(result, GateResult) and result.passed, result.detail
    assert "gpu-001" not in result.nodes


@pytest.mark.django_db
def test_an_older_driver_still_passes_a_cluster_that_chose_an_older_cuda(fleet, settings, eager, tomorrow,
                                                                        django_capture_on_commit_callbacks):
    from provisioning.services import RetryLater

    settings.PORTAL_FAKE_NVML = fleet_spec({"gpu-001": [{"kind": "cuda_mismatch"}]})  # supports 12.2
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    cluster = gate_cluster(booking, "12.2")
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    assert health_acceptance_gate(cluster=cluster).passed
    assert fleet.node("gpu-001").state == "available"


@pytest.mark.django_db
def test_the_gates_answer_counts_one_missing_node_in_the_singular(fleet, settings, eager, tomorrow,
                                                                  django_capture_on_commit_callbacks):
    """A cluster handed over one node short was told "…; 1 node(s) missing: no spare was free"."""
    from provisioning.services import RetryLater
    from reservations.models import Reservation

    settings.PORTAL_FAKE_NVML = fleet_spec()
    booking = fleet.book("alpha", ["gpu-001"], tomorrow, tomorrow + timedelta(hours=3), "provisioning")
    Reservation.objects.filter(pk=booking.pk).update(node_count=2, missing_nodes=1)  # one failed, no spare
    cluster = gate_cluster(booking, "12.8")
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RetryLater):
        health_acceptance_gate(cluster=cluster)
    result = health_acceptance_gate(cluster=cluster)
    assert result.passed and result.detail.endswith("; 1 node missing: no spare was free"), result.detail
