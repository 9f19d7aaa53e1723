"""The cluster's CUDA version against the highest one the node's driver supports (check cuda_support).

NVML's nvmlSystemGetCudaDriverVersion is the newest CUDA the installed driver runs; a driver runs every
older CUDA too, so the check fails only when the driver's is below the cluster's chosen version.
"""

from __future__ import annotations

import pytest

from provisioning.health.agent import main
from provisioning.health.checks import check_cuda_support
from provisioning.health.fake_nvml import FakeNvml, Fault
from provisioning.health.runner import SimulatedFleet, run_job

from .conftest import check, quick


@pytest.mark.parametrize(
    ("supported", "required", "status"),
    [
        ("12.2", "12.4", "fail"),  # below
        ("12.4", "12.4", "pass"),  # equal
        ("12.8", "12.4", "pass"),  # above: a driver runs older CUDA versions
        ("13.0", "12.8", "pass"),  # a newer major
        ("12.8", "13.0", "fail"),
        ("12.10", "12.8", "pass"),  # numeric, not text: 12.10 is newer than 12.8
        ("12.8", "12.10", "fail"),
        ("12.9", "12.10", "fail"),
        ("12.4", "12.4.1", "pass"),  # major.minor is what the driver's support says
    ],
)
def test_the_driver_must_support_the_clusters_cuda_version(supported: str, required: str, status: str) -> None:
    result = check_cuda_support(supported, required)
    assert (result.name, str(result.status), result.value, result.threshold) == (
        "cuda_support", status, supported, required)
    assert str(result.action) == ("none" if status == "pass" else "investigate")


def test_a_failure_says_what_the_driver_supports_and_what_the_cluster_needs() -> None:
    result = check_cuda_support("12.2", "12.4")
    assert result.message == "driver supports CUDA 12.2; CUDA 12.4 is required"


def test_an_unreadable_cuda_version_is_unknown_never_a_pass() -> None:
    result = check_cuda_support(None, "12.4", "NVMLError_Unknown: Unknown Error")
    assert str(result.status) == "unknown" and "NVMLError_Unknown" in result.message


def test_a_required_version_that_is_no_version_is_unknown() -> None:
    result = check_cuda_support("12.4", "latest")
    assert str(result.status) == "unknown" and "'latest'" in result.message


def test_an_old_driver_fails_the_node_with_the_reason_in_its_problems() -> None:
    report = quick(FakeNvml(faults=[Fault("cuda_mismatch")], seed=3), cuda_min="12.4")
    assert report["verdict"] == "fail" and report["cuda_version"] == "12.2"
    found = check(report, "cuda_support")
    assert (found["status"], found["action"]) == ("fail", "investigate")
    assert {"gpu": None, "check": "cuda_support", "status": "fail", "action": "investigate",
            "message": "driver supports CUDA 12.2; CUDA 12.4 is required"} in report["problems"]


def test_a_driver_supporting_the_version_or_newer_passes() -> None:
    for cuda in (12040, 12080, 13000):
        report = quick(FakeNvml(cuda=cuda, seed=3), cuda_min="12.4", cuda_pin=None)
        assert check(report, "cuda_support")["status"] == "pass", cuda
        assert report["verdict"] == "pass"


def test_an_unreadable_cuda_driver_version_makes_the_check_unknown() -> None:
    fake = FakeNvml(faults=[Fault("not_supported", call="nvmlSystemGetCudaDriverVersion")], seed=3)
    report = quick(fake, cuda_min="12.4")
    assert check(report, "cuda_support")["status"] == "unknown"
    assert report["verdict"] == "unknown"


def test_without_a_required_version_there_is_no_such_check() -> None:
    """A job without the cluster's version (an idle node's, an older portal's) runs as before."""
    report = quick(FakeNvml(faults=[Fault("cuda_mismatch")], seed=3))
    assert "cuda_support" not in [c["name"] for c in report["node_checks"]]
    assert report["verdict"] == "warn"  # only the fleet pin's warning, as before


def _job(**extra):
    return {"id": 1, "host": "gpu-001", "level": "quick", "model": "H100-SXM", "gpus": 8, "idle": True,
            "peers": [], "pins": {}, "detail": "compact", **extra}


def test_a_job_carrying_the_clusters_cuda_version_checks_it() -> None:
    fleet = SimulatedFleet({"default": {}, "nodes": {"gpu-001": {"cuda": 12020}}})
    report = fleet.run(_job(cuda_min="12.4"))
    assert report["verdict"] == "fail"
    assert [p["message"] for p in report["problems"] if p["check"] == "cuda_support"] == [
        "driver supports CUDA 12.2; CUDA 12.4 is required"]
    assert fleet.run(_job(cuda_min="12.2"))["verdict"] == "pass"
    # The job format stays compatible: a job without it (or with null) is judged as before.
    assert fleet.run(_job())["verdict"] == "pass"
    assert "cuda_support" not in fleet.run(_job(cuda_min=None))["node_passed"]


def test_run_job_passes_the_required_version_to_the_checks() -> None:
    report = run_job(_job(cuda_min="12.8", detail="full"), nvml=FakeNvml(cuda=12080, seed=2), event_wait_ms=0)
    assert check(report, "cuda_support")["status"] == "pass"


def test_the_simulated_fleet_supports_every_cuda_version_the_portal_offers() -> None:
    """A healthy simulated node must pass any cluster's version, or the demo's every booking would fail."""
    from reservations.choices import CUDA_VERSIONS

    fleet = SimulatedFleet(None)
    for version in CUDA_VERSIONS:
        assert fleet.run(_job(cuda_min=version))["verdict"] == "pass", version


def test_the_cli_takes_the_required_version(capsys) -> None:
    code = main(["--json", "--fake", '{"faults": [{"kind": "cuda_mismatch"}]}', "--cuda-min", "12.4",
                 "--event-wait-ms", "0"])
    out = capsys.readouterr().out
    assert code == 2 and "driver supports CUDA 12.2; CUDA 12.4 is required" in out
