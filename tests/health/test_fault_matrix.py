"""Every injectable fault => the expected GPU verdict, node verdict, recommended action and check."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from provisioning.health.agent import run_checks
from provisioning.health.fake_nvml import FAULT_KINDS, FakeNvml, Fault
from provisioning.health.xid import XID_POLICY

from .conftest import PINS, check, quick, validate_report

TARGET = 3  # the GPU that per-GPU faults hit


@dataclass(frozen=True)
class Case:
    """One row of the matrix."""

    fault: Fault
    gpu_verdict: str | None  # the target GPU's verdict; None: every GPU passes (a node-level fault)
    node_verdict: str
    action: str
    check: str  # the check that must carry the finding
    on_gpu: bool = True  # whether that check is on the target GPU (else a node check)
    model: str = "H100-SXM"
    options: tuple[tuple[str, Any], ...] = ()
    every_gpu: bool = False  # the GPU verdict applies to every GPU, not only the target

    @property
    def id(self) -> str:
        extra = "-".join(f"{k}={v}" for k, v in self.fault.params.items())
        return f"{self.fault.kind}{'-' + extra if extra else ''}-{self.model}"


def g(kind: str, **params: Any) -> Fault:
    """Return a fault on the target GPU."""
    return Fault(kind, gpu=TARGET, **params)


CASES = [
    # 1. init failures: no GPU can be enumerated at all
    Case(Fault("init_failure", error="DriverNotLoaded"), None, "fail", "reboot", "nvml_init", on_gpu=False),
    Case(Fault("init_failure", error="LibraryNotFound"), None, "fail", "investigate", "nvml_init", on_gpu=False),
    Case(Fault("init_failure", error="LibRmVersionMismatch"), None, "fail", "reboot", "nvml_init", on_gpu=False),
    Case(Fault("init_failure", error="NoPermission"), None, "unknown", "investigate", "nvml_init", on_gpu=False),
    Case(Fault("init_failure", error="Unknown"), None, "unknown", "investigate", "nvml_init", on_gpu=False),
    # 2. device loss
    Case(Fault("gpu_missing"), None, "fail", "reseat", "gpu_count", on_gpu=False),
    Case(g("gpu_lost"), "fail", "fail", "reseat", "gpu_accessible"),
    Case(g("fallen_off_bus"), "fail", "fail", "reseat", "gpu_accessible"),
    Case(
        g("nvml_error", call="nvmlDeviceGetPowerUsage", error="Unknown"), "unknown", "unknown", "investigate", "power"
    ),
    Case(
        g("hang", call="nvmlDeviceGetPowerUsage", seconds=1.5),
        "unknown",
        "unknown",
        "investigate",
        "responsive",
        options=(("nvml_timeout_s", 0.4),),
    ),
    # 3. unsupported readings: unknown, never pass; an old driver falls back to the old API
    Case(g("not_supported", call="nvmlDeviceGetPcieReplayCounter"), "unknown", "unknown", "investigate", "pcie_replay"),
    Case(
        g("function_not_found", call="nvmlDeviceGetCurrentClocksEventReasons"), "pass", "pass", "none", "clock_events"
    ),
    Case(g("missing_function", call="nvmlDeviceGetCurrentClocksEventReasons"), "pass", "pass", "none", "clock_events"),
    # 4. ECC
    Case(g("ecc_uncorrected"), "fail", "fail", "drain_and_reset", "ecc_uncorrected_volatile"),
    Case(g("ecc_uncorrected_aggregate"), "warn", "warn", "monitor", "ecc_uncorrected_aggregate"),
    Case(g("ecc_corrected_sram"), "warn", "warn", "monitor", "ecc_corrected"),
    Case(g("ecc_corrected_dram"), "warn", "warn", "monitor", "ecc_corrected"),
    Case(g("ecc_corrected_growing"), "warn", "warn", "monitor", "ecc_corrected"),
    Case(g("ecc_sram_uncorrected"), "fail", "fail", "replace_gpu", "ecc_corrected"),
    Case(g("ecc_disabled"), "unknown", "unknown", "investigate", "ecc_uncorrected_volatile"),
    # 5. memory repair
    Case(g("remap_pending"), "fail", "fail", "drain_and_reset", "row_remap"),
    Case(g("remap_failure"), "fail", "fail", "replace_gpu", "row_remap"),
    Case(g("remap_uncorrected"), "fail", "fail", "replace_gpu", "row_remap"),
    Case(g("retired_pages"), "fail", "fail", "replace_gpu", "retired_pages", model="V100-SXM2"),
    Case(g("retired_pages", count=20), "warn", "warn", "monitor", "retired_pages", model="V100-SXM2"),
    Case(g("retired_pages_pending"), "warn", "warn", "reset_when_idle", "retired_pages", model="V100-SXM2"),
    # 6. clock events: each slowdown bit warns, idle and power cap are normal
    Case(g("clock_event", bits=0x08), "warn", "warn", "monitor", "clock_events"),
    Case(g("clock_event", bits=0x20), "warn", "warn", "monitor", "clock_events"),
    Case(g("clock_event", bits=0x40), "warn", "warn", "monitor", "clock_events"),
    Case(g("clock_event", bits=0x80), "warn", "warn", "monitor", "clock_events"),
    Case(g("clock_event", bits=0x04 | 0x40 | 0x80), "warn", "warn", "monitor", "clock_events"),
    Case(g("clock_event", bits=0x01 | 0x02 | 0x04), "pass", "pass", "none", "clock_events"),
    # 7. temperature and power
    Case(g("hot"), "warn", "warn", "monitor", "temperature"),
    Case(g("overtemp"), "fail", "fail", "investigate", "temperature"),
    Case(
        g("not_supported", call="nvmlDeviceGetTemperatureThreshold"), "unknown", "unknown", "investigate", "temperature"
    ),
    Case(g("power_over_limit"), "warn", "warn", "monitor", "power"),
    Case(g("power_capped"), "warn", "warn", "investigate", "power"),
    # a board without power telemetry: DCGM raises nothing for NOT_SUPPORTED power, nor do we
    Case(g("power_not_supported"), "pass", "pass", "none", "power"),
    Case(g("not_supported", call="nvmlDeviceGetPowerUsage"), "pass", "pass", "none", "power"),
    # 8. PCIe
    Case(g("pcie_degraded"), "warn", "warn", "reseat", "pcie_link"),
    Case(g("pcie_replay"), "warn", "warn", "monitor", "pcie_replay"),
    # 9. NVLink and fabric
    Case(g("nvlink_down", link=4), "fail", "fail", "drain_and_reset", "nvlink_state"),
    Case(g("nvlink_errors", counter="replay"), "warn", "warn", "monitor", "nvlink_errors"),
    Case(g("nvlink_errors", counter="recovery"), "warn", "warn", "monitor", "nvlink_errors"),
    Case(g("fabric_incomplete"), "fail", "fail", "drain_and_reset", "fabric"),
    Case(g("fabric_incomplete", state="not_started"), "fail", "fail", "drain_and_reset", "fabric"),
    # 10. configuration
    Case(g("mig_pending"), "warn", "warn", "reset_when_idle", "mig_mode"),
    Case(g("persistence_off"), "warn", "warn", "monitor", "persistence_mode"),
    Case(Fault("driver_mismatch"), None, "warn", "investigate", "driver_version", on_gpu=False),
    Case(Fault("cuda_mismatch"), None, "warn", "investigate", "cuda_version", on_gpu=False),
    Case(g("vbios_mismatch"), "pass", "warn", "investigate", "vbios_consistency", on_gpu=False),
    # 11. XIDs (each XID of the policy table is covered separately below)
    Case(g("xid", xid=79, source="event", gi=1, ci=0), "fail", "fail", "reseat", "xid"),
    Case(g("xid", xid=48, source="both"), "fail", "fail", "drain_and_reset", "xid"),
    Case(g("xid", xid=31, repeat=3), "pass", "pass", "none", "xid"),
    # the k8s device plugin marks every GPU unhealthy here (KDP); we say unknown for each
    Case(Fault("event_wait_error"), "unknown", "unknown", "investigate", "xid_events", on_gpu=False, every_gpu=True),
    # 12. processes
    Case(g("stray_process"), "fail", "fail", "drain_and_reset", "compute_processes"),
]


def _run(case: Case) -> dict[str, Any]:
    fake = FakeNvml(model=case.model, faults=[case.fault], seed=11, hostname="gpu-node-1")
    return quick(fake, **dict(case.options))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fault_gives_expected_verdicts_and_action(case: Case) -> None:
    report = _run(case)
    assert report["verdict"] == case.node_verdict
    assert report["recommended_action"] == case.action
    found = check(report, case.check, TARGET if case.on_gpu else None)
    if case.node_verdict != "pass":
        assert found["status"] != "pass", found
        problems = {(p["gpu"], p["check"]) for p in report["problems"]}
        assert (TARGET if case.on_gpu else None, case.check) in problems
    if case.gpu_verdict is None:
        assert all(gpu["verdict"] == "pass" for gpu in report["gpus"])
    elif case.every_gpu:
        assert {gpu["verdict"] for gpu in report["gpus"]} == {case.gpu_verdict}
    else:
        target = report["gpus"][TARGET]
        assert target["verdict"] == case.gpu_verdict
        if case.gpu_verdict != "pass":
            assert target["action"] == case.action
        others = [gpu["verdict"] for gpu in report["gpus"] if gpu["index"] != TARGET]
        assert others == ["pass"] * len(others), "a fault on one GPU leaked to others"


def test_every_fault_kind_is_in_the_matrix() -> None:
    assert {case.fault.kind for case in CASES} == set(FAULT_KINDS)


@pytest.mark.parametrize("xid", sorted(XID_POLICY) + [999])
def test_every_xid_follows_the_policy(xid: int) -> None:
    report = quick(FakeNvml(faults=[g("xid", xid=xid)], seed=2))
    policy = XID_POLICY.get(xid)
    expected_status = str(policy.status) if policy else "warn"
    expected_action = str(policy.action) if policy else "investigate"
    xid_result = check(report, "xid", TARGET)
    assert xid_result["status"] == expected_status
    assert xid_result["action"] == expected_action
    assert [entry["xid"] for entry in xid_result["value"]] == [xid]
    assert xid_result["value"][0]["sources"] == ["kernel_log"]
    assert report["verdict"] == expected_status


@pytest.mark.parametrize("model", ["H100-SXM", "A100-80GB", "L40S", "V100-SXM2"])
def test_healthy_node_passes_on_every_gpu(model: str) -> None:
    report = quick(FakeNvml(model=model, seed=5))
    assert report["verdict"] == "pass"
    assert report["recommended_action"] == "none"
    assert report["problems"] == []
    assert report["gpu_model"] == model
    assert len(report["gpus"]) == 8
    for gpu in report["gpus"]:
        assert gpu["verdict"] == "pass"
        assert gpu["uuid"].startswith("GPU-")
        assert all(c["status"] == "pass" for c in gpu["checks"]), gpu["checks"]
    assert report["parts_ran"] == ["nvml", "xid_events", "xid_log"]
    assert report["parts_unknown"] == []


def test_checks_follow_the_model() -> None:
    """NVLink/fabric/MIG checks run only where the model has them; pre-Ampere uses page retirement."""
    names = {
        model: [c["name"] for c in quick(FakeNvml(model=model, gpus=1))["gpus"][0]["checks"]]
        for model in ("H100-SXM", "A100-80GB", "L40S", "V100-SXM2")
    }
    assert {"nvlink_state", "fabric", "mig_mode", "row_remap"} <= set(names["H100-SXM"])
    assert "fabric" not in names["A100-80GB"] and "mig_mode" in names["A100-80GB"]
    assert not {"nvlink_state", "nvlink_errors", "fabric", "mig_mode"} & set(names["L40S"])
    assert "retired_pages" in names["V100-SXM2"] and "row_remap" not in names["V100-SXM2"]


def test_unprofiled_consumer_gpu_is_never_pass() -> None:
    """A consumer card answers remapped rows with zeros; without a profile that is unknown (GPUD351)."""
    report = quick(FakeNvml(model="RTX-4090", gpus=1))
    assert report["verdict"] == "unknown"
    assert check(report, "gpu_model")["status"] == "unknown"
    assert check(report, "gpu_count")["status"] == "unknown"
    assert check(report, "row_remap", 0)["status"] == "unknown"
    assert check(report, "ecc_uncorrected_volatile", 0)["status"] == "unknown"
    assert report["gpus"][0]["serial"] is None


def test_node_verdict_is_worst_of_gpus_and_node_checks() -> None:
    fake = FakeNvml(faults=[Fault("persistence_off", gpu=1), Fault("remap_pending", gpu=6), Fault("driver_mismatch")])
    report = quick(fake)
    assert [gpu["verdict"] for gpu in report["gpus"]] == [
        "pass",
        "warn",
        "pass",
        "pass",
        "pass",
        "pass",
        "fail",
        "pass",
    ]
    assert report["verdict"] == "fail"
    # the failing GPU's action wins over the warnings' actions
    assert report["recommended_action"] == "drain_and_reset"
    assert {(p["gpu"], p["check"]) for p in report["problems"]} == {
        (1, "persistence_mode"),
        (6, "row_remap"),
        (None, "driver_version"),
    }


def test_fallen_off_bus_gpu_xid_is_judged_at_node_level() -> None:
    report = quick(FakeNvml(faults=[Fault("fallen_off_bus", gpu=5)]))
    lost = report["gpus"][5]
    assert lost["uuid"] is None and lost["verdict"] == "fail" and lost["action"] == "reseat"
    xid_log = check(report, "xid_log")
    assert xid_log["status"] == "fail"
    assert xid_log["value"][0]["xid"] == 79
    assert xid_log["value"][0]["pci"] == ["00000000:ab:00.0"]


def test_gpu_missing_counts_the_remaining_gpus() -> None:
    report = quick(FakeNvml(faults=[Fault("gpu_missing", gpu=2)]))
    assert check(report, "gpu_count")["value"] == 7
    assert check(report, "gpu_count")["threshold"] == 8
    assert len(report["gpus"]) == 7


def test_pool_model_mismatch_fails() -> None:
    report = quick(FakeNvml(model="A100-80GB", gpus=8), model="H100-SXM")
    assert check(report, "gpu_model")["status"] == "fail"
    assert report["verdict"] == "fail"


def test_unknown_pool_model_is_unknown_not_detected() -> None:
    report = quick(FakeNvml(seed=2), model="B300-NVL72")
    result = check(report, "gpu_model")
    assert result["status"] == "unknown"
    assert "B300-NVL72" in result["message"]
    assert report["verdict"] == "unknown"


def test_processes_are_allowed_when_the_node_is_in_use() -> None:
    """They are the work of the team using the node; the report (read by the team booked next too, when the
    acceptance gate checks a node still in use) counts them and names no pid or memory use."""
    fake = FakeNvml(faults=[Fault("stray_process", gpu=0, pid=777, used_mib=31337)])
    report = validate_report(run_checks("quick", fake, expect_idle=False, event_wait_ms=0, **PINS))
    result = check(report, "compute_processes", 0)
    assert result["status"] == "pass"
    assert result["value"] == {"count": 1}
    assert "777" not in json.dumps(result) and "31337" not in json.dumps(result)


def test_stray_processes_on_an_idle_node_are_named() -> None:
    fake = FakeNvml(faults=[Fault("stray_process", gpu=0, pid=777)])
    result = check(quick(fake), "compute_processes", 0)
    assert result["status"] == "fail" and result["value"] == [{"pid": 777, "used_mib": 1024}]
