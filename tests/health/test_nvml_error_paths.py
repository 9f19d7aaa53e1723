"""NVML error paths: unknown process lists, XIDs of GPUs that fell off, hardware return codes, handle faults."""

from __future__ import annotations

from typing import Any

import pynvml

from provisioning.health.agent import run_checks
from provisioning.health.fake_nvml import FakeNvml, Fault

from .conftest import PINS, ToolBox, check, validate_report

MEDIUM_PARTS = ["dcgm_diag", "nvbandwidth", "nccl_all_reduce"]


def _install_healthy(toolbox: ToolBox) -> None:
    toolbox.install("dcgmi", "dcgmi_diag_r2_pass.json")
    toolbox.install("nvbandwidth", "nvbandwidth_h100_pass.txt")
    toolbox.install("all_reduce_perf", "nccl_all_reduce_h100_pass.txt")


def _run(level: str, fake: FakeNvml, **kwargs: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"event_wait_ms": 0, **PINS, **kwargs}
    return validate_report(run_checks(level, fake, **options))


# 1. Active tests run although nobody knows whether a tenant process holds a GPU.
def test_unreadable_processes_block_active_tests(toolbox: ToolBox) -> None:
    """NVML docs: in MIG mode the parent-device process list needs privileges (NoPermission);
    an old driver raises NVMLLibraryMismatchError. Unknown must not be treated as 'idle'."""
    _install_healthy(toolbox)
    fake = FakeNvml(
        seed=4,
        hostname="gpu-h100-001",
        faults=[Fault("nvml_error", gpu=2, call="nvmlDeviceGetComputeRunningProcesses", error="NoPermission")],
    )
    report = _run("medium", fake)
    assert check(report, "compute_processes", gpu=2)["status"] == "unknown"
    assert not (toolbox.bindir / "dcgmi.args").exists(), "dcgmi diag ran on a GPU whose processes are unknown"
    for part in MEDIUM_PARTS:
        assert check(report, part)["status"] == "unknown"


def test_hung_gpu_blocks_active_tests(toolbox: ToolBox) -> None:
    """A GPU whose NVML calls hung never reached its process check: not known to be idle."""
    _install_healthy(toolbox)
    fake = FakeNvml(
        seed=4, hostname="gpu-h100-001",
        faults=[Fault("hang", gpu=1, call="nvmlDeviceGetPowerUsage", seconds=3)],
    )
    report = _run("medium", fake, nvml_timeout_s=0.5)
    assert not (toolbox.bindir / "dcgmi.args").exists(), "dcgmi diag ran while GPU 1's checks were still hanging"
    dcgm = [c for c in report["node_checks"] if c["name"] == "dcgm_diag"]
    assert [c["message"] for c in dcgm] == ["not run: GPU 1 is not known to be idle"]


# 2. A live XID whose device can no longer be named is silently dropped.
class _FallsOffOnEvent(FakeNvml):
    """The GPU falls off the bus as its XID 79 is delivered: its UUID is unreadable from then on."""

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:  # noqa: N802 - pynvml's name
        data = super().nvmlEventSetWait(event_set, timeout_ms)
        self.gpus[data.device.physical_index].lost = True
        return data


def test_live_xid_of_unresolvable_gpu_is_not_dropped() -> None:
    fake = _FallsOffOnEvent(
        seed=4, hostname="gpu-h100-001", faults=[Fault("xid", gpu=3, xid=79, source="event")]
    )
    report = _run("quick", fake, kernel_log=lambda: [])
    assert report["verdict"] == "fail", report["problems"]
    assert any("79" in (p["message"] or "") for p in report["problems"]), report["problems"]


# 3. NVML errors that are themselves hardware findings are reported as "unknown" (no drain).
def test_hardware_nvml_errors_fail_the_gpu() -> None:
    """nvmlReturn_t: INSUFFICIENT_POWER 'external power cables are not properly attached',
    RESET_REQUIRED 'the GPU requires a reset before it can be used again'."""
    for error in ("InsufficientPower", "ResetRequired", "IrqIssue"):
        fake = FakeNvml(
            seed=4, hostname="gpu-h100-001",
            faults=[Fault("nvml_error", call="nvmlDeviceGetHandleByIndex", error=error)],
        )
        report = _run("quick", fake, kernel_log=lambda: [])
        result = check(report, "gpu_accessible", gpu=0)
        assert result["status"] == "fail", (error, result)
        assert report["verdict"] == "fail", error


# 4. The fake silently ignores per-GPU faults on nvmlDeviceGetHandleByIndex.
def test_fake_applies_per_gpu_faults_to_get_handle_by_index() -> None:
    fake = FakeNvml(seed=4, faults=[Fault("nvml_error", gpu=2, call="nvmlDeviceGetHandleByIndex", error="Unknown")])
    fake.nvmlInit()
    fake.nvmlDeviceGetHandleByIndex(1)  # other GPUs unaffected
    try:
        fake.nvmlDeviceGetHandleByIndex(2)
    except pynvml.NVMLError_Unknown:
        pass
    else:
        raise AssertionError("Fault(nvml_error, gpu=2, call=nvmlDeviceGetHandleByIndex) was silently ignored")
    report = _run("quick", FakeNvml(seed=4, faults=[Fault("nvml_error", gpu=2, call="nvmlDeviceGetHandleByIndex",
                                                          error="Unknown")]), kernel_log=lambda: [])
    assert check(report, "gpu_accessible", gpu=2)["status"] == "unknown"


def test_a_per_gpu_fault_on_a_call_that_names_no_gpu_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="takes no GPU"):
        Fault("nvml_error", gpu=1, call="nvmlDeviceGetCount", error="Unknown")
    with pytest.raises(ValueError, match="takes no GPU"):
        Fault.from_dict({"kind": "hang", "gpu": 0, "call": "nvmlEventSetWait", "seconds": 1})
    Fault("nvml_error", call="nvmlDeviceGetCount", error="Unknown")  # every call of it: fine


# 5. NVLink error counters that could not be read were reported as "no NVLink errors".
def test_unreadable_nvlink_error_counters_are_unknown_never_pass() -> None:
    """nvmlDeviceGetNvLinkErrorCounter answering InvalidArgument on an H100's links (all 18 up) read
    nothing, yet the check passed with "no new NVLink errors" (a reading NVML refuses is unknown)."""
    fake = FakeNvml(seed=4, hostname="gpu-h100-001", faults=[
        Fault("nvml_error", gpu=3, call="nvmlDeviceGetNvLinkErrorCounter", error="InvalidArgument")])
    report = _run("quick", fake)
    assert check(report, "nvlink_state", gpu=3)["status"] == "pass"
    result = check(report, "nvlink_errors", gpu=3)
    assert result["status"] == "unknown", result
    assert result["value"]["unread_links"] == list(range(18))
    assert check(report, "nvlink_errors", gpu=2)["status"] == "pass"
    assert report["verdict"] == "unknown"
