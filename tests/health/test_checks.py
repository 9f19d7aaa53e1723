"""The read-error rule, API fallbacks and counter baselines of the NVML checks."""

from __future__ import annotations

import pytest

from provisioning.health.checks import GpuContext, check_clock_events, check_pcie_link, check_temperature
from provisioning.health.fake_nvml import FakeNvml, Fault
from provisioning.health.thresholds import H100_SXM
from provisioning.health.xid import HealthState

from .conftest import check, quick


def _calls_of_a_healthy_run() -> list[str]:
    fake = FakeNvml(seed=1)
    quick(fake)
    return sorted(fake.call_counts)


# Calls whose failure is deliberately not a finding: inventory fields reported as null, cleanup.
NOT_JUDGED = {
    "nvmlDeviceGetSerial",  # boards without a serial are usable; the report shows null
    "nvmlDeviceGetPciInfo",  # only maps kernel-log XIDs; unmapped XIDs are still judged (xid_log)
    "nvmlEventSetFree",
    "nvmlShutdown",
    "nvmlInit",  # covered by the init_failure rows of the fault matrix
}
JUDGED_CALLS = [call for call in _calls_of_a_healthy_run() if call not in NOT_JUDGED]


def test_the_sweep_covers_every_reading() -> None:
    """Guard the sweep below: it must see all the calls the checks make (names from pynvml)."""
    for call in (
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlEventSetWait",
        "nvmlDeviceGetCount",
        "nvmlSystemGetCudaDriverVersion",
    ):
        assert call in JUDGED_CALLS
    assert len(JUDGED_CALLS) >= 30


ERRORS = ["NotSupported", "Unknown", "NoPermission", "Timeout"]
# Not errors: Timeout is nvmlEventSetWait's normal "no event arrived" answer, and NotSupported from a
# power call is a board without power telemetry, which DCGM does not flag either (tested below).
EXPECTED_ANSWERS = {
    ("nvmlEventSetWait", "Timeout"),
    ("nvmlDeviceGetPowerUsage", "NotSupported"),
    ("nvmlDeviceGetEnforcedPowerLimit", "NotSupported"),
}
SWEEP = [(call, error) for call in JUDGED_CALLS for error in ERRORS if (call, error) not in EXPECTED_ANSWERS]


@pytest.mark.parametrize(("call", "error"), SWEEP)
def test_a_read_error_is_never_a_pass(call: str, error: str) -> None:
    report = quick(FakeNvml(seed=1, faults=[Fault("nvml_error", call=call, error=error)]))
    assert report["verdict"] == "unknown", [p for p in report["problems"]]
    assert report["recommended_action"] == "investigate"
    statuses = {p["status"] for p in report["problems"]}
    assert statuses == {"unknown"}
    assert any(error in p["message"] or call in p["message"] for p in report["problems"])


def test_gpu_lost_mid_run_fails_and_stops_that_gpu() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("nvml_error", gpu=2, call="nvmlDeviceGetPowerUsage", error="GpuIsLost")])
    report = quick(fake)
    checks = report["gpus"][2]["checks"]
    assert checks[-2]["name"] == "power" and checks[-2]["status"] == "fail"
    assert checks[-2]["action"] == "reseat"
    # nothing after the loss but the XID verdict
    assert [c["name"] for c in checks].index("power") == len(checks) - 2
    assert report["verdict"] == "fail"


def test_calls_before_init_raise_uninitialized() -> None:
    import pynvml

    fake = FakeNvml()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


@pytest.mark.parametrize("how", ["function_not_found", "missing_function"])
def test_clock_reasons_fall_back_to_throttle_reasons(how: str) -> None:
    fake = FakeNvml(
        seed=1,
        faults=[
            Fault(how, call="nvmlDeviceGetCurrentClocksEventReasons"),
            Fault("clock_event", gpu=4, bits=0x20),
        ],
    )
    report = quick(fake)
    result = check(report, "clock_events", 4)
    assert result["status"] == "warn"
    assert result["value"]["api"] == "nvmlDeviceGetCurrentClocksThrottleReasons"
    assert "sw_thermal_slowdown" in result["value"]["active"]
    assert fake.call_counts["nvmlDeviceGetCurrentClocksThrottleReasons"] == 8


def test_clock_reasons_without_either_api_are_unknown() -> None:
    fake = FakeNvml(
        seed=1,
        faults=[
            Fault("function_not_found", call="nvmlDeviceGetCurrentClocksEventReasons"),
            Fault("function_not_found", call="nvmlDeviceGetCurrentClocksThrottleReasons"),
        ],
    )
    fake.nvmlInit()
    ctx = GpuContext(index=0, thresholds=H100_SXM)
    result = check_clock_events(fake, fake.nvmlDeviceGetHandleByIndex(0), ctx)
    assert result.status == "unknown"
    assert "FunctionNotFound" in result.message


def test_temperature_falls_back_to_the_legacy_call() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("missing_function", call="nvmlDeviceGetTemperatureV"), Fault("hot", gpu=0)])
    fake.nvmlInit()
    result = check_temperature(fake, fake.nvmlDeviceGetHandleByIndex(0), GpuContext(0, H100_SXM))
    assert result.status == "warn"
    assert result.value == 84
    assert result.threshold == {"slowdown_c": 87, "warn_c": 82, "source": "nvml"}


def test_unreadable_threshold_still_fails_a_temperature_above_the_model_limit() -> None:
    fake = FakeNvml(
        seed=1,
        faults=[Fault("not_supported", call="nvmlDeviceGetTemperatureThreshold"), Fault("overtemp", gpu=0)],
    )
    fake.nvmlInit()
    result = check_temperature(fake, fake.nvmlDeviceGetHandleByIndex(0), GpuContext(0, H100_SXM))
    assert result.status == "fail"
    assert result.threshold == {"slowdown_c": 87, "source": "model"}


def test_pcie_floor_is_enforced_only_under_load() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("pcie_degraded", gpu=0, width=16, gen=2)])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    idle = check_pcie_link(fake, handle, GpuContext(0, H100_SXM))
    loaded = check_pcie_link(fake, handle, GpuContext(0, H100_SXM, under_load=True))
    assert idle.status == "pass" and "idle downshift" in idle.message
    assert loaded.status == "fail" and loaded.action == "reseat"


# --- counters judged as deltas against the state's baseline ---------------------------------------


def test_nvlink_errors_growing_since_the_last_run_fail() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("nvlink_errors", gpu=1, link=2, counter="replay", rate=3)])
    state = HealthState()
    first = quick(fake, state=state)
    assert check(first, "nvlink_errors", 1)["status"] == "warn"  # no baseline yet
    second = quick(fake, state=state)
    result = check(second, "nvlink_errors", 1)
    assert result["status"] == "fail"
    assert result["action"] == "drain_and_reset"
    assert result["value"]["new"]["replay"] == 3
    assert check(second, "nvlink_errors", 0)["status"] == "pass"


def test_nvlink_crc_errors_warn_below_the_rate_limit() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("nvlink_errors", gpu=0, link=7, counter="crc_flit", rate=2)])
    state = HealthState()
    first = quick(fake, state=state)
    assert check(first, "nvlink_errors", 0)["status"] == "pass"  # CRC alone, no baseline: reported only
    # pretend the previous reading was a minute ago: 2 errors/min is far below 100/s
    for readings in state.counters.values():
        for reading in readings.values():
            reading[1] -= 60
    second = quick(fake, state=state)
    result = check(second, "nvlink_errors", 0)
    assert result["status"] == "warn"
    assert result["value"]["new"]["crc_flit"] == 2


def test_pcie_replay_rate_uses_the_baseline() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("pcie_replay", gpu=0, rate=10)])
    state = HealthState()
    quick(fake, state=state)
    for readings in state.counters.values():
        readings["pcie_replay"][1] -= 60  # one minute ago
    slow = check(quick(fake, state=state), "pcie_replay", 0)
    assert slow["status"] == "pass"
    assert slow["value"]["per_min"] == pytest.approx(10, rel=0.05)
    fast = FakeNvml(seed=1, faults=[Fault("pcie_replay", gpu=0, rate=100)])
    state = HealthState()
    quick(fast, state=state)
    for readings in state.counters.values():
        readings["pcie_replay"][1] -= 60
    result = check(quick(fast, state=state), "pcie_replay", 0)
    assert result["status"] == "warn"
    assert result["threshold"] == {"per_min": 31.0}


def test_aggregate_ecc_is_history_once_a_baseline_exists() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("ecc_uncorrected_aggregate", gpu=0)])
    state = HealthState()
    assert check(quick(fake, state=state), "ecc_uncorrected_aggregate", 0)["status"] == "warn"
    assert check(quick(fake, state=state), "ecc_uncorrected_aggregate", 0)["status"] == "pass"


def test_a_counter_reset_is_not_a_negative_delta() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("pcie_replay", gpu=0, rate=5)])
    state = HealthState()
    quick(fake, state=state)
    uuid = next(iter(state.counters))
    state.counters[uuid]["pcie_replay"] = [10_000.0, state.counters[uuid]["pcie_replay"][1] - 60]
    result = check(quick(fake, state=state), "pcie_replay", 0)
    assert "per_min" not in result["value"]  # treated as "no baseline", not as -9990 replays


# --- power readings a board does not support (DCGM: NOT_SUPPORTED is no incident) ----------------


def test_power_a_gpu_does_not_support_passes_with_a_note_saying_so() -> None:
    """DCGM's power watch raises DCGM_FR_POWER_UNREADABLE only for a blank reading that is not
    DCGM_FP64_NOT_SUPPORTED (DH, MonitorPower): a board without power telemetry is not a finding.
    Left unknown, such a node could never be handed over."""
    report = quick(FakeNvml(seed=1, faults=[Fault("power_not_supported", gpu=2)]))
    power = check(report, "power", 2)
    assert power["status"] == "pass" and power["action"] == "none"
    assert power["value"] == {"draw_w": None, "limit_w": None,
                              "not_supported": ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit"]}
    assert "not supported" in power["message"] and "not judged" in power["message"]
    assert report["verdict"] == "pass" and report["problems"] == []


def test_power_draw_not_supported_still_judges_the_enforced_limit() -> None:
    fake = FakeNvml(seed=1, faults=[Fault("power_not_supported", gpu=0, only="usage"), Fault("power_capped", gpu=0)])
    power = check(quick(fake), "power", 0)
    assert power["status"] == "warn" and power["action"] == "investigate"
    assert power["value"]["draw_w"] is None and power["value"]["limit_w"] == 420.0
    assert power["value"]["not_supported"] == ["nvmlDeviceGetPowerUsage"]


def test_power_limit_not_supported_passes_the_draw_with_a_note() -> None:
    power = check(quick(FakeNvml(seed=1, faults=[Fault("power_not_supported", gpu=0, only="limit")])), "power", 0)
    assert power["status"] == "pass"
    assert power["value"]["limit_w"] is None and power["value"]["draw_w"] > 0
    assert "nvmlDeviceGetEnforcedPowerLimit not supported" in power["message"]


@pytest.mark.parametrize("call", ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit"])
@pytest.mark.parametrize("error", ["Unknown", "NoPermission", "Timeout"])
def test_a_power_reading_that_fails_stays_unknown(call: str, error: str) -> None:
    """Only NotSupported is the board's answer; any other error is a reading we could not take."""
    power = check(quick(FakeNvml(seed=1, faults=[Fault("nvml_error", gpu=1, call=call, error=error)])), "power", 1)
    assert power["status"] == "unknown" and power["action"] == "investigate"
    assert error in power["message"]


def test_power_fault_rejects_an_unknown_only() -> None:
    with pytest.raises(ValueError, match="only="):
        FakeNvml(faults=[Fault("power_not_supported", only="draw")])
