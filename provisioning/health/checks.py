"""The NVML checks of one GPU node (research table "(a) Checks"), each judged against its model.

Every per-GPU check is a function ``check(nvml, handle, ctx) -> CheckResult`` where ``nvml`` is
the real ``pynvml`` module (nvidia-ml-py) or a ``FakeNvml`` with the same names and shapes. The
one rule that matters most: a reading NVML refuses (NotSupported, FunctionNotFound, any error)
is ``unknown`` with its reason, never ``pass``; only ``GpuIsLost`` is a finding in itself. The one
exception is power: a board without power telemetry answers NotSupported there, which DCGM does not
flag either (``check_power``).
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

from .results import Action, CheckResult, Status, counted, gpus_named, recommended_action, worst_status
from .thresholds import GpuModelThresholds
from .xid import KernelXid, format_pci, without_process, xid_policy

Nvml = Any  # the pynvml module or a FakeNvml: same function names, return shapes and errors

NVML_ERRORS: tuple[type[BaseException], ...] = (pynvml.NVMLError,) + (
    (pynvml.NVMLLibraryMismatchError,) if hasattr(pynvml, "NVMLLibraryMismatchError") else ()
)

# Clock-event bits that mean the hardware is protecting itself (research: warn, crit in burn-in).
BAD_CLOCK_EVENTS: dict[int, str] = {
    pynvml.nvmlClocksEventReasonHwSlowdown: "hw_slowdown",
    pynvml.nvmlClocksEventReasonSwThermalSlowdown: "sw_thermal_slowdown",
    pynvml.nvmlClocksEventReasonHwThermalSlowdown: "hw_thermal_slowdown",
    pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "hw_power_brake_slowdown",
}
# Bits that are normal operation and must not raise anything.
BENIGN_CLOCK_EVENTS: dict[int, str] = {
    pynvml.nvmlClocksEventReasonGpuIdle: "gpu_idle",
    pynvml.nvmlClocksEventReasonApplicationsClocksSetting: "applications_clocks_setting",
    pynvml.nvmlClocksEventReasonSwPowerCap: "sw_power_cap",
    pynvml.nvmlClocksEventReasonSyncBoost: "sync_boost",
    pynvml.nvmlClocksEventReasonDisplayClockSetting: "display_clock_setting",
}

FABRIC_STATES: dict[int, str] = {
    pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
    pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
    pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
    pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
}

NVLINK_COUNTERS: dict[str, int] = {
    "replay": pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    "recovery": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
    "crc_flit": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
}

MEMORY_LOCATIONS: dict[str, int] = {
    "sram": pynvml.NVML_MEMORY_LOCATION_SRAM,
    "dram": pynvml.NVML_MEMORY_LOCATION_DRAM,
}


def describe_error(exc: BaseException) -> str:
    """Return "NVMLError_NotSupported (Not Supported)" style text for an NVML error."""
    return f"{type(exc).__name__} ({exc})"


@dataclass
class GpuContext:
    """What a per-GPU check needs besides NVML: thresholds, options, counter baselines."""

    index: int
    thresholds: GpuModelThresholds
    uuid: str | None = None
    # Previous counter readings {name: [value, unix_time]} from the state file; empty on first run.
    baseline: Mapping[str, Sequence[float]] = field(default_factory=dict)
    readings: dict[str, list[float]] = field(default_factory=dict)
    now: float = field(default_factory=time.time)
    # Processes on a GPU are only a finding on a node that should be idle (before hand-over).
    expect_idle: bool = True
    # PCIe links downshift when idle; gen/width floors are only enforced under load (BAAZ).
    under_load: bool = False
    # The NVML call in flight, so a hung call can be named by the watchdog.
    current_call: str = ""

    def call(self, nvml: Nvml, name: str, *args: Any) -> Any:
        """Call one NVML function by name, treating a binding that lacks it as FunctionNotFound."""
        self.current_call = name
        function = getattr(nvml, name, None)
        if function is None:
            # Old nvidia-ml-py releases lack newer wrappers; that is the same situation as an old driver.
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return function(*args)

    def call_first(self, nvml: Nvml, names: Sequence[str], *args: Any) -> tuple[str, Any]:
        """Call the first of several equivalent functions that exists (newest first)."""
        last: BaseException | None = None
        for name in names:
            try:
                return name, self.call(nvml, name, *args)
            except pynvml.NVMLError_FunctionNotFound as exc:
                last = exc
        assert last is not None
        raise last

    def counter_delta(self, name: str, value: float) -> tuple[float, float] | None:
        """Record a counter reading; return (delta, seconds) since the baseline, if there is one.

        A counter lower than its baseline was reset (driver reload, reboot): no delta then.
        """
        self.readings[name] = [float(value), self.now]
        previous = self.baseline.get(name)
        if not previous or len(previous) < 2 or value < previous[0] or self.now <= previous[1]:
            return None
        return float(value) - float(previous[0]), self.now - float(previous[1])


CheckFn = Callable[[Nvml, Any, GpuContext], CheckResult]


# Marks the message of a result produced by GpuIsLost; later checks of that GPU are pointless.
GPU_LOST = "GPU is lost"


def is_gpu_lost(result: CheckResult) -> bool:
    """Tell whether a result says the GPU was lost mid-run."""
    return result.status is Status.FAIL and GPU_LOST in result.message


# NVML return codes that are findings about the hardware itself, not a reading we could not take
# (nvmlReturn_t: "external power cables are not properly attached", "interrupt issue with a GPU",
# "infoROM is corrupted", "the GPU requires a reset before it can be used again").
HARDWARE_NVML_ERRORS: dict[str, tuple[str, Action]] = {
    "NVMLError_InsufficientPower": ("external power cables not properly attached", Action.RESEAT),
    "NVMLError_IrqIssue": ("the kernel driver detected an interrupt issue with the GPU", Action.REBOOT),
    "NVMLError_CorruptedInforom": ("the GPU's infoROM is corrupted", Action.REPLACE_GPU),
    "NVMLError_ResetRequired": ("the GPU requires a reset before it can be used again", Action.DRAIN_AND_RESET),
}


def nvml_error_result(name: str, exc: BaseException, call: str, threshold: Any = None) -> CheckResult:
    """Turn an NVML error into a result: a lost or faulty GPU fails, anything else is unknown."""
    if isinstance(exc, pynvml.NVMLError_GpuIsLost):
        return CheckResult(
            name,
            Status.FAIL,
            threshold=threshold,
            message=f"{call}: {GPU_LOST} (fallen off the bus or stopped responding)",
            action=Action.RESEAT,
        )
    hardware = HARDWARE_NVML_ERRORS.get(type(exc).__name__)
    if hardware is not None:
        meaning, action = hardware
        return CheckResult(
            name, Status.FAIL, threshold=threshold, message=f"{call}: {meaning} ({describe_error(exc)})", action=action
        )
    return CheckResult(
        name,
        Status.UNKNOWN,
        threshold=threshold,
        message=f"{call or 'NVML'} failed: {describe_error(exc)}; not judged",
        action=Action.INVESTIGATE,
    )


def nvml_check(name: str) -> Callable[[Callable[..., CheckResult]], CheckFn]:
    """Wrap a check so that an NVML error becomes an unknown (or, if the GPU is lost, failing) result."""

    def decorate(function: Callable[..., CheckResult]) -> CheckFn:
        @functools.wraps(function)
        def run(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
            try:
                return function(nvml, handle, ctx)
            except NVML_ERRORS as exc:
                return nvml_error_result(name, exc, ctx.current_call)

        run.check_name = name  # type: ignore[attr-defined]
        return run

    return decorate


# --- identity -----------------------------------------------------------------------------------


@dataclass
class GpuIdentity:
    """What identifies a GPU in reports and in the kernel log."""

    name: str
    uuid: str
    serial: str | None
    pci: tuple[int, int, int] | None
    vbios: str | None
    # Why an optional field is null: {"vbios": "nvmlDeviceGetVbiosVersion: NVMLError_..."}.
    errors: dict[str, str] = field(default_factory=dict)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def read_identity(nvml: Nvml, handle: Any, ctx: GpuContext) -> GpuIdentity:
    """Read name and UUID (errors propagate: without them the GPU is unusable) and the optional rest."""
    name = _text(ctx.call(nvml, "nvmlDeviceGetName", handle))
    uuid = _text(ctx.call(nvml, "nvmlDeviceGetUUID", handle))
    optional: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for key, call in (
        ("serial", "nvmlDeviceGetSerial"),
        ("pci", "nvmlDeviceGetPciInfo"),
        ("vbios", "nvmlDeviceGetVbiosVersion"),
    ):
        try:
            optional[key] = ctx.call(nvml, call, handle)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except NVML_ERRORS as exc:
            # Boards without a serial (some PCIe SKUs) are still usable; the report shows null.
            optional[key] = None
            errors[key] = f"{call}: {describe_error(exc)}"
    pci_info = optional["pci"]
    pci = (int(pci_info.domain), int(pci_info.bus), int(pci_info.device)) if pci_info is not None else None
    return GpuIdentity(
        name=name,
        uuid=uuid,
        serial=_text(optional["serial"]) if optional["serial"] is not None else None,
        pci=pci,
        vbios=_text(optional["vbios"]) if optional["vbios"] is not None else None,
        errors=errors,
    )


# --- per-GPU checks -----------------------------------------------------------------------------


@nvml_check("persistence_mode")
def check_persistence_mode(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Warn when persistence mode is off: the driver then tears down state between jobs (DSW)."""
    mode = ctx.call(nvml, "nvmlDeviceGetPersistenceMode", handle)
    if mode == nvml.NVML_FEATURE_ENABLED:
        return CheckResult("persistence_mode", Status.PASS, "enabled", "enabled", "persistence mode on")
    return CheckResult(
        "persistence_mode",
        Status.WARN,
        "disabled",
        "enabled",
        "persistence mode is off; enable it (nvidia-smi -pm 1 or nvidia-persistenced)",
        Action.MONITOR,
    )


@nvml_check("ecc_mode")
def check_ecc_mode(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Warn when ECC is off on a model that should run with it, or will change at the next reset."""
    current, pending = ctx.call(nvml, "nvmlDeviceGetEccMode", handle)
    value = {"current": "enabled" if current else "disabled", "pending": "enabled" if pending else "disabled"}
    if not ctx.thresholds.ecc_expected:
        return CheckResult("ecc_mode", Status.PASS, value, None, "ECC not required for this model")
    if current == nvml.NVML_FEATURE_ENABLED and pending == nvml.NVML_FEATURE_ENABLED:
        return CheckResult("ecc_mode", Status.PASS, value, "enabled", "ECC enabled")
    if current == nvml.NVML_FEATURE_ENABLED:
        return CheckResult(
            "ecc_mode", Status.WARN, value, "enabled", "ECC will be disabled at the next reset", Action.INVESTIGATE
        )
    action = Action.RESET_WHEN_IDLE if pending == nvml.NVML_FEATURE_ENABLED else Action.INVESTIGATE
    return CheckResult("ecc_mode", Status.WARN, value, "enabled", "ECC is disabled", action)


@nvml_check("ecc_uncorrected_volatile")
def check_ecc_uncorrected_volatile(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Fail on any uncorrected ECC error since the last driver load: drain the GPU and reset (DH, DE)."""
    count = ctx.call(
        nvml,
        "nvmlDeviceGetTotalEccErrors",
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_VOLATILE_ECC,
    )
    if count > 0:
        return CheckResult(
            "ecc_uncorrected_volatile",
            Status.FAIL,
            count,
            0,
            f"{counted(count, 'uncorrected ECC error')} since the driver loaded; drain the GPU and reset it",
            Action.DRAIN_AND_RESET,
        )
    return CheckResult("ecc_uncorrected_volatile", Status.PASS, count, 0, "no uncorrected ECC errors")


@nvml_check("ecc_uncorrected_aggregate")
def check_ecc_uncorrected_aggregate(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Judge lifetime uncorrected ECC errors by their growth; without a baseline, flag any as history."""
    count = ctx.call(
        nvml,
        "nvmlDeviceGetTotalEccErrors",
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_AGGREGATE_ECC,
    )
    delta = ctx.counter_delta("ecc_uncorrected_aggregate", count)
    if delta is not None and delta[0] > 0:
        return CheckResult(
            "ecc_uncorrected_aggregate",
            Status.FAIL,
            {"total": count, "new": int(delta[0])},
            0,
            f"{counted(int(delta[0]), 'new uncorrected ECC error')} since the last check",
            Action.DRAIN_AND_RESET,
        )
    if delta is None and count > 0:
        # Aggregate counters survive reboots: without a baseline this may be long-repaired history.
        return CheckResult(
            "ecc_uncorrected_aggregate",
            Status.WARN,
            {"total": count},
            0,
            f"{counted(count, 'uncorrected ECC error')} over the GPU's life; no baseline to tell whether "
            f"{'it is' if count == 1 else 'they are'} new",
            Action.MONITOR,
        )
    return CheckResult("ecc_uncorrected_aggregate", Status.PASS, {"total": count}, 0, "no new uncorrected errors")


@nvml_check("ecc_corrected")
def check_ecc_corrected(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Judge per-location lifetime ECC counts against Azure's H100 limits (AZ)."""
    t = ctx.thresholds
    value: dict[str, int] = {}
    for location in t.ecc_locations:
        code = MEMORY_LOCATIONS[location]
        for kind, error_type in (
            ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            value[f"{location}_{kind}"] = int(
                ctx.call(nvml, "nvmlDeviceGetMemoryErrorCounter", handle, error_type, nvml.NVML_AGGREGATE_ECC, code)
            )
    threshold = {"sram_corrected": t.ecc_sram_corrected_warn, "dram_corrected": t.ecc_dram_corrected_warn}
    if value.get("sram_uncorrected", 0) > 0:
        return CheckResult(
            "ecc_corrected",
            Status.FAIL,
            value,
            {**threshold, "sram_uncorrected": 0},
            f"{counted(value['sram_uncorrected'], 'uncorrected SRAM error')}; the GPU should be replaced",
            Action.REPLACE_GPU,
        )
    over = [
        key
        for key, limit in (
            ("sram_corrected", t.ecc_sram_corrected_warn),
            ("dram_corrected", t.ecc_dram_corrected_warn),
        )
        if value.get(key, 0) > limit
    ]
    if over:
        return CheckResult(
            "ecc_corrected",
            Status.WARN,
            value,
            threshold,
            "corrected ECC errors above limit: " + ", ".join(f"{k}={value[k]}" for k in over),
            Action.MONITOR,
        )
    return CheckResult("ecc_corrected", Status.PASS, value, threshold, "corrected ECC counts within limits")


@nvml_check("row_remap")
def check_row_remap(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Judge the row remapper (Ampere+): failure or exhaustion replaces, pending needs a reset."""
    corrected, uncorrected, pending, failure = ctx.call(nvml, "nvmlDeviceGetRemappedRows", handle)
    value = {"correctable": corrected, "uncorrectable": uncorrected, "pending": bool(pending), "failure": bool(failure)}
    limit = ctx.thresholds.remap_uncorrected_fail
    threshold = {"failure": False, "pending": False, "uncorrectable_below": limit}
    if not ctx.thresholds.profiled:
        # Some products answer success with zeros without tracking anything (GPUD351).
        return CheckResult(
            "row_remap",
            Status.UNKNOWN,
            value,
            threshold,
            "model not profiled; remapped-row readings are not trusted on unprofiled products",
            Action.INVESTIGATE,
        )
    if failure:
        return CheckResult(
            "row_remap", Status.FAIL, value, threshold, "row remapping failed; replace the GPU", Action.REPLACE_GPU
        )
    if uncorrected >= limit:
        return CheckResult(
            "row_remap",
            Status.FAIL,
            value,
            threshold,
            f"{uncorrected} rows remapped for uncorrectable errors (limit {limit}); replace the GPU",
            Action.REPLACE_GPU,
        )
    if pending:
        return CheckResult(
            "row_remap",
            Status.FAIL,
            value,
            threshold,
            "a row remap is pending; drain the GPU and reset it to apply it",
            Action.DRAIN_AND_RESET,
        )
    return CheckResult("row_remap", Status.PASS, value, threshold, "row remapper healthy")


@nvml_check("retired_pages")
def check_retired_pages(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Judge dynamic page retirement (pre-Ampere): 63 pages exhaust the GPU (DPR)."""
    t = ctx.thresholds
    sbe = ctx.call(
        nvml, "nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    )
    dbe = ctx.call(nvml, "nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    pending = ctx.call(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    total = len(sbe) + len(dbe)
    value = {"single_bit": len(sbe), "double_bit": len(dbe), "total": total, "pending": bool(pending)}
    threshold = {"total_below": t.retired_pages_fail, "double_bit_max": t.retired_dbe_warn, "pending": False}
    if total >= t.retired_pages_fail:
        return CheckResult(
            "retired_pages",
            Status.FAIL,
            value,
            threshold,
            f"{total} retired pages (limit {t.retired_pages_fail}); replace the GPU",
            Action.REPLACE_GPU,
        )
    if pending:
        return CheckResult(
            "retired_pages",
            Status.WARN,
            value,
            threshold,
            "a page retirement is pending; reset the GPU when idle",
            Action.RESET_WHEN_IDLE,
        )
    if len(dbe) > t.retired_dbe_warn:
        return CheckResult(
            "retired_pages", Status.WARN, value, threshold, f"{len(dbe)} pages retired for DBEs", Action.MONITOR
        )
    return CheckResult("retired_pages", Status.PASS, value, threshold, "page retirement within limits")


@nvml_check("clock_events")
def check_clock_events(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Warn on hardware/thermal slowdown bits; idle, app clocks and power cap are normal (NVMLC, AZ)."""
    # Drivers before 535 only know the old name (AZ): fall back on FunctionNotFound.
    api, mask = ctx.call_first(
        nvml,
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        handle,
    )
    bad = [name for bit, name in BAD_CLOCK_EVENTS.items() if mask & bit]
    benign = [name for bit, name in BENIGN_CLOCK_EVENTS.items() if mask & bit]
    value = {"mask": f"0x{mask:x}", "active": bad + benign, "api": api}
    threshold = {"forbidden": sorted(BAD_CLOCK_EVENTS.values())}
    if bad:
        return CheckResult(
            "clock_events",
            Status.WARN,
            value,
            threshold,
            "clocks slowed by " + ", ".join(bad) + "; check cooling and power delivery",
            Action.MONITOR,
        )
    return CheckResult("clock_events", Status.PASS, value, threshold, "no hardware or thermal slowdown")


@nvml_check("temperature")
def check_temperature(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Fail at NVML's slowdown threshold, warn a margin below it (GCM; margin is our proposal)."""
    t = ctx.thresholds
    _, temperature = ctx.call_first(
        nvml, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle, nvml.NVML_TEMPERATURE_GPU
    )
    try:
        slowdown = ctx.call(nvml, "nvmlDeviceGetTemperatureThreshold", handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        source = "nvml"
    except pynvml.NVMLError_GpuIsLost:
        raise
    except NVML_ERRORS as exc:
        fallback = t.temp_slowdown_fallback_c
        if fallback is not None and temperature >= fallback:
            # The threshold is unreadable, but a reading above the model's known limit is still a finding.
            return CheckResult(
                "temperature",
                Status.FAIL,
                temperature,
                {"slowdown_c": fallback, "source": "model"},
                f"{temperature} C is at or above the model's slowdown temperature {fallback} C",
                Action.INVESTIGATE,
            )
        return CheckResult(
            "temperature",
            Status.UNKNOWN,
            temperature,
            None,
            f"slowdown threshold unreadable ({describe_error(exc)}); {temperature} C not judged",
            Action.INVESTIGATE,
        )
    threshold = {"slowdown_c": slowdown, "warn_c": slowdown - t.temp_warn_margin_c, "source": source}
    if temperature >= slowdown:
        return CheckResult(
            "temperature",
            Status.FAIL,
            temperature,
            threshold,
            f"{temperature} C is at or above the slowdown threshold {slowdown} C; check cooling",
            Action.INVESTIGATE,
        )
    if temperature >= slowdown - t.temp_warn_margin_c:
        return CheckResult(
            "temperature",
            Status.WARN,
            temperature,
            threshold,
            f"{temperature} C is within {t.temp_warn_margin_c} C of slowdown ({slowdown} C)",
            Action.MONITOR,
        )
    return CheckResult("temperature", Status.PASS, temperature, threshold, f"{temperature} C")


def _power_reading(nvml: Nvml, call: str, handle: Any, ctx: GpuContext, unsupported: list[str]) -> float | None:
    """Read one power value in watts; None (and the call noted) when the board does not support it.

    Only NotSupported is the board's answer: every other error propagates and makes the check unknown.
    """
    try:
        return ctx.call(nvml, call, handle) / 1000.0
    except pynvml.NVMLError_NotSupported:
        unsupported.append(call)
        return None


@nvml_check("power")
def check_power(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Warn when draw exceeds the enforced limit, or the enforced limit sits below the model's TDP.

    A reading the board does not support (NotSupported: boards and modes without power telemetry) is
    not judged and is no finding, as in DCGM's power watch, which flags a blank power reading only when
    it is not DCGM_FP64_NOT_SUPPORTED (DH): left unknown, such a GPU could never pass a hand-over check.
    A power reading that fails any other way stays unknown.
    """
    t = ctx.thresholds
    unsupported: list[str] = []
    draw_w = _power_reading(nvml, "nvmlDeviceGetPowerUsage", handle, ctx, unsupported)
    limit_w = _power_reading(nvml, "nvmlDeviceGetEnforcedPowerLimit", handle, ctx, unsupported)
    value: dict[str, Any] = {
        "draw_w": round(draw_w, 1) if draw_w is not None else None,
        "limit_w": round(limit_w, 1) if limit_w is not None else None,
    }
    if unsupported:
        value["not_supported"] = unsupported
    threshold = {
        "max_draw_w": round(limit_w * t.power_over_limit_ratio, 1) if limit_w is not None else None,
        "min_limit_w": round(t.power_limit_w * t.power_limit_min_ratio, 1) if t.power_limit_w else None,
    }
    note = "; " + ", ".join(f"{call} not supported on this GPU" for call in unsupported) if unsupported else ""
    if draw_w is not None and limit_w is not None and draw_w > limit_w * t.power_over_limit_ratio:
        return CheckResult(
            "power",
            Status.WARN,
            value,
            threshold,
            f"drawing {draw_w:.0f} W over the enforced limit of {limit_w:.0f} W",
            Action.MONITOR,
        )
    if limit_w is not None and t.power_limit_w and limit_w < t.power_limit_w * t.power_limit_min_ratio:
        return CheckResult(
            "power",
            Status.WARN,
            value,
            threshold,
            f"enforced power limit {limit_w:.0f} W is below the model's {t.power_limit_w:.0f} W{note}",
            Action.INVESTIGATE,
        )
    if draw_w is None and limit_w is None:
        return CheckResult(
            "power", Status.PASS, value, threshold, "power readings not supported on this GPU; not judged"
        )
    if draw_w is None:
        return CheckResult("power", Status.PASS, value, threshold, f"limit {limit_w:.0f} W; draw not judged{note}")
    if limit_w is None:
        return CheckResult("power", Status.PASS, value, threshold, f"{draw_w:.0f} W; not judged against a limit{note}")
    return CheckResult("power", Status.PASS, value, threshold, f"{draw_w:.0f} W of {limit_w:.0f} W")


@nvml_check("pcie_link")
def check_pcie_link(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Judge PCIe generation and width: capability below the floor fails; idle downshift is normal."""
    t = ctx.thresholds
    cur_gen = ctx.call(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)
    cur_width = ctx.call(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)
    max_gen = ctx.call(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle)
    max_width = ctx.call(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle)
    value = {"gen": cur_gen, "width": cur_width, "max_gen": max_gen, "max_width": max_width}
    threshold = {"min_gen": t.pcie_gen_min, "min_width": t.pcie_width_min, "under_load": ctx.under_load}
    if max_gen < t.pcie_gen_min or max_width < t.pcie_width_min:
        return CheckResult(
            "pcie_link",
            Status.FAIL,
            value,
            threshold,
            f"link can reach at most gen {max_gen} x{max_width}, below gen {t.pcie_gen_min} x{t.pcie_width_min}",
            Action.RESEAT,
        )
    if cur_width < t.pcie_width_min:
        status = Status.FAIL if ctx.under_load else Status.WARN
        return CheckResult(
            "pcie_link",
            status,
            value,
            threshold,
            f"link trained at x{cur_width}, expected x{t.pcie_width_min}; reseat the GPU or riser",
            Action.RESEAT,
        )
    if ctx.under_load and cur_gen < t.pcie_gen_min:
        return CheckResult(
            "pcie_link",
            Status.FAIL,
            value,
            threshold,
            f"link at gen {cur_gen} under load, floor is gen {t.pcie_gen_min}",
            Action.RESEAT,
        )
    if ctx.under_load and cur_gen < max_gen:
        return CheckResult(
            "pcie_link", Status.WARN, value, threshold, f"link at gen {cur_gen} of {max_gen} under load", Action.MONITOR
        )
    note = " (idle downshift is normal)" if cur_gen < max_gen else ""
    return CheckResult("pcie_link", Status.PASS, value, threshold, f"gen {cur_gen} x{cur_width}{note}")


@nvml_check("pcie_replay")
def check_pcie_replay(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Warn when PCIe replays grow faster than the per-lane limit (DH); without a baseline use DCGM's total."""
    t = ctx.thresholds
    count = ctx.call(nvml, "nvmlDeviceGetPcieReplayCounter", handle)
    delta = ctx.counter_delta("pcie_replay", count)
    if delta is not None:
        per_min = delta[0] / (delta[1] / 60.0)
        value = {"total": count, "new": int(delta[0]), "per_min": round(per_min, 2)}
        threshold = {"per_min": t.pcie_replay_rate_per_min}
        if per_min > t.pcie_replay_rate_per_min:
            return CheckResult(
                "pcie_replay",
                Status.WARN,
                value,
                threshold,
                f"{per_min:.1f} PCIe replays/min, limit {t.pcie_replay_rate_per_min}",
                Action.MONITOR,
            )
        return CheckResult("pcie_replay", Status.PASS, value, threshold, f"{per_min:.1f} replays/min")
    value = {"total": count}
    threshold = {"total": t.pcie_replay_warn_total}
    if count > t.pcie_replay_warn_total:
        return CheckResult(
            "pcie_replay",
            Status.WARN,
            value,
            threshold,
            f"{count} PCIe replays since driver load (no baseline for a rate)",
            Action.MONITOR,
        )
    return CheckResult("pcie_replay", Status.PASS, value, threshold, f"{count} PCIe replays")


_ABSENT_LINK_ERRORS = (pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_NotSupported)


@nvml_check("nvlink_state")
def check_nvlink_state(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Fail when fewer NVLink links are up than the model has (H100 SXM: 18) (DH, AZ)."""
    expected = ctx.thresholds.nvlink_links
    up: list[int] = []
    down: list[int] = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            active = ctx.call(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        except _ABSENT_LINK_ERRORS:
            continue  # past the device's link count NVML answers InvalidArgument or NotSupported
        (up if active == nvml.NVML_FEATURE_ENABLED else down).append(link)
    value = {"up": len(up), "down_links": down}
    if not up and not down:
        return CheckResult(
            "nvlink_state",
            Status.UNKNOWN,
            value,
            expected,
            "no NVLink link state readable (NotSupported/InvalidArgument on every link)",
            Action.INVESTIGATE,
        )
    if len(up) < expected:
        return CheckResult(
            "nvlink_state",
            Status.FAIL,
            value,
            expected,
            f"{len(up)} of {expected} NVLink links up; down: {down or 'missing links'}",
            Action.DRAIN_AND_RESET,
        )
    return CheckResult("nvlink_state", Status.PASS, value, expected, f"{len(up)} NVLink links up")


@nvml_check("nvlink_errors")
def check_nvlink_errors(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Fail on new replay/recovery errors or CRC >= 100/s; without a baseline any replay/recovery warns (DH)."""
    t = ctx.thresholds
    totals = {name: 0 for name in NVLINK_COUNTERS}
    new = {name: 0.0 for name in NVLINK_COUNTERS}
    crc_rate = 0.0
    have_baseline = True
    unread: list[int] = []
    for link in range(t.nvlink_links):
        for name, counter in NVLINK_COUNTERS.items():
            try:
                count = ctx.call(nvml, "nvmlDeviceGetNvLinkErrorCounter", handle, link, counter)
            except pynvml.NVMLError_InvalidArgument:
                unread.append(link)  # NVML says the link does not exist; nvlink_state reports that
                break
            totals[name] += count
            delta = ctx.counter_delta(f"nvlink.{link}.{name}", count)
            if delta is None:
                have_baseline = False
                continue
            new[name] += delta[0]
            if name == "crc_flit":
                crc_rate = max(crc_rate, delta[0] / delta[1])
    value: dict[str, Any] = {"totals": totals}
    threshold = {"replay_new": 0, "recovery_new": 0, "crc_flit_per_s_below": t.nvlink_crc_fail_per_s}
    if have_baseline:
        value["new"] = {name: int(amount) for name, amount in new.items()}
        value["crc_flit_per_s"] = round(crc_rate, 2)
        if new["replay"] >= 1 or new["recovery"] >= 1 or crc_rate >= t.nvlink_crc_fail_per_s:
            return CheckResult(
                "nvlink_errors",
                Status.FAIL,
                value,
                threshold,
                "NVLink errors since the last check: " + ", ".join(f"{k}={int(v)}" for k, v in new.items() if v),
                Action.DRAIN_AND_RESET,
            )
    if unread:
        # Counters not read are not "no errors": at most the links that were read are judged.
        value["unread_links"] = unread
        return CheckResult(
            "nvlink_errors",
            Status.UNKNOWN,
            value,
            threshold,
            f"NVLink error counters unreadable (InvalidArgument) on {len(unread)} of {t.nvlink_links} links: {unread}",
            Action.INVESTIGATE,
        )
    if have_baseline:
        if new["crc_flit"] > 0:
            return CheckResult(
                "nvlink_errors",
                Status.WARN,
                value,
                threshold,
                f"{int(new['crc_flit'])} new NVLink CRC flit errors",
                Action.MONITOR,
            )
        return CheckResult("nvlink_errors", Status.PASS, value, threshold, "no new NVLink errors")
    if totals["replay"] or totals["recovery"]:
        return CheckResult(
            "nvlink_errors",
            Status.WARN,
            value,
            threshold,
            f"NVLink replay={totals['replay']} recovery={totals['recovery']} since driver load (no baseline)",
            Action.MONITOR,
        )
    return CheckResult("nvlink_errors", Status.PASS, value, threshold, "no NVLink replay or recovery errors")


def _read_fabric(nvml: Nvml, handle: Any, ctx: GpuContext) -> tuple[int, int]:
    """Return (state, status) of the GPU's NVSwitch fabric registration, newest API first."""
    try:
        info = nvml.c_nvmlGpuFabricInfo_v2_t()
        ctx.call(nvml, "nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info))
    except pynvml.NVMLError_FunctionNotFound:
        info = nvml.c_nvmlGpuFabricInfo_t()
        ctx.call(nvml, "nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info))
    return int(info.state), int(info.status)


@nvml_check("fabric")
def check_fabric(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Fail until the fabric manager has registered the GPU with the NVSwitch fabric (DG, PY)."""
    state, status = _read_fabric(nvml, handle, ctx)
    value = {"state": FABRIC_STATES.get(state, str(state)), "status": status}
    if state == nvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
        return CheckResult(
            "fabric", Status.UNKNOWN, value, "completed", "fabric state not supported here", Action.INVESTIGATE
        )
    if state != nvml.NVML_GPU_FABRIC_STATE_COMPLETED:
        return CheckResult(
            "fabric",
            Status.FAIL,
            value,
            "completed",
            f"NVSwitch fabric registration is {value['state']}; check nvidia-fabricmanager, then reset",
            Action.DRAIN_AND_RESET,
        )
    if status != pynvml.NVML_SUCCESS:
        return CheckResult(
            "fabric",
            Status.FAIL,
            value,
            "completed",
            f"fabric registration finished with error {status}",
            Action.DRAIN_AND_RESET,
        )
    return CheckResult("fabric", Status.PASS, value, "completed", "fabric registration completed")


@nvml_check("mig_mode")
def check_mig_mode(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Warn when a MIG mode change waits for a GPU reset (PY)."""
    current, pending = ctx.call(nvml, "nvmlDeviceGetMigMode", handle)
    value = {"current": "enabled" if current else "disabled", "pending": "enabled" if pending else "disabled"}
    if current != pending:
        return CheckResult(
            "mig_mode",
            Status.WARN,
            value,
            "current == pending",
            "MIG mode change pending; reset the GPU when idle",
            Action.RESET_WHEN_IDLE,
        )
    return CheckResult("mig_mode", Status.PASS, value, "current == pending", f"MIG {value['current']}")


@nvml_check("compute_processes")
def check_compute_processes(nvml: Nvml, handle: Any, ctx: GpuContext) -> CheckResult:
    """Fail when compute processes hold a GPU that should be idle (GCM); report them otherwise."""
    processes = ctx.call(nvml, "nvmlDeviceGetComputeRunningProcesses", handle)
    if not ctx.expect_idle:
        # The processes are the work of the team using the node. The report may be read by another team (the
        # acceptance gate checks a node still in use for the booking that follows): count them, name none.
        return CheckResult(
            "compute_processes", Status.PASS, {"count": len(processes)}, None,
            f"{counted(len(processes), 'compute process', 'compute processes')} of the node's current work",
        )
    value = [
        {"pid": int(p.pid), "used_mib": (int(p.usedGpuMemory) // (1024 * 1024)) if p.usedGpuMemory else None}
        for p in processes
    ]
    if processes:
        return CheckResult(
            "compute_processes",
            Status.FAIL,
            value,
            [],
            # The ids stay in the readings (staff's view); the message reaches the teams booked on the node.
            f"{counted(len(value), 'stray compute process', 'stray compute processes')} on an idle GPU",
            Action.DRAIN_AND_RESET,
        )
    return CheckResult("compute_processes", Status.PASS, value, [], "no compute processes")


def process_count(result: CheckResult) -> int:
    """Return how many compute processes a compute_processes result read: its list of them on a node that
    should be idle, {"count": n} on a node in use; 0 when none were read (an unknown result)."""
    value = result.value
    if isinstance(value, Mapping):
        return int(value.get("count") or 0)
    return len(value or [])


def gpu_checks_for(thresholds: GpuModelThresholds) -> list[CheckFn]:
    """Return the per-GPU checks that apply to a model, in report order."""
    checks: list[CheckFn] = [
        check_persistence_mode,
        check_ecc_mode,
        check_ecc_uncorrected_volatile,
        check_ecc_uncorrected_aggregate,
        check_ecc_corrected,
        check_retired_pages if thresholds.memory_repair == "page_retirement" else check_row_remap,
        check_clock_events,
        check_temperature,
        check_power,
        check_pcie_link,
        check_pcie_replay,
    ]
    if thresholds.nvlink_links:
        checks += [check_nvlink_state, check_nvlink_errors]
    if thresholds.fabric_manager:
        checks.append(check_fabric)
    if thresholds.mig_capable:
        checks.append(check_mig_mode)
    checks.append(check_compute_processes)
    return checks


# --- XIDs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveXid:
    """One XID (or ECC) event delivered by nvmlEventSetWait."""

    gpu_index: int | None
    xid: int
    event_type: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class XidEventWatcher:
    """Subscribe to critical XID and ECC events on every GPU and drain them (KDP).

    Events only arrive while registered, so registration happens before the other checks and
    draining after them: the check run itself is the listening window.
    """

    EVENT_MASK_NAMES = ("nvmlEventTypeXidCriticalError", "nvmlEventTypeDoubleBitEccError")

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self.event_set: Any = None
        self.registered: dict[int, str] = {}
        # Registered handles by index: an event's device is matched by handle, since a GPU that
        # just raised XID 79 may no longer answer nvmlDeviceGetUUID.
        self.handles: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.wait_error: str | None = None
        self.create_error: str | None = None

    def register(self, index: int, handle: Any, uuid: str) -> None:
        """Register one GPU; a failure is remembered as that GPU's reason for an unknown live part."""
        nvml = self.nvml
        try:
            if self.event_set is None and self.create_error is None:
                self.event_set = nvml.nvmlEventSetCreate()
        except NVML_ERRORS as exc:
            self.create_error = describe_error(exc)
        if self.event_set is None:
            self.errors[index] = f"nvmlEventSetCreate failed: {self.create_error}"
            return
        mask = 0
        for name in self.EVENT_MASK_NAMES:
            mask |= getattr(nvml, name)
        try:
            nvml.nvmlDeviceRegisterEvents(handle, mask, self.event_set)
        except pynvml.NVMLError_NotSupported:
            # ECC events are unsupported with ECC off; XIDs alone are still worth listening to.
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.event_set)
            except NVML_ERRORS as exc:
                self.errors[index] = f"nvmlDeviceRegisterEvents failed: {describe_error(exc)}"
                return
        except NVML_ERRORS as exc:
            self.errors[index] = f"nvmlDeviceRegisterEvents failed: {describe_error(exc)}"
            return
        self.registered[index] = uuid
        self.handles[index] = handle

    def drain(self, wait_ms: int, max_events: int = 1000) -> list[LiveXid]:
        """Collect the events that arrived, waiting at most wait_ms in total for more."""
        if self.event_set is None or not self.registered:
            return []
        nvml = self.nvml
        by_uuid = {uuid: index for index, uuid in self.registered.items()}
        deadline = time.monotonic() + wait_ms / 1000.0
        events: list[LiveXid] = []
        while len(events) < max_events:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            try:
                data = nvml.nvmlEventSetWait(self.event_set, remaining_ms)
            except pynvml.NVMLError_Timeout:
                break
            except NVML_ERRORS as exc:
                # The k8s device plugin marks every GPU unhealthy here (KDP); we can only say unknown.
                self.wait_error = f"nvmlEventSetWait failed: {describe_error(exc)}"
                break
            key = _handle_key(data.device)
            index = next(
                (i for i, handle in self.handles.items() if key is not None and _handle_key(handle) == key), None
            )
            if index is None:
                try:
                    index = by_uuid.get(_text(nvml.nvmlDeviceGetUUID(data.device)))
                except NVML_ERRORS:
                    index = None  # kept with no GPU: the node-level xid_events check judges it
            if data.eventType == nvml.nvmlEventTypeDoubleBitEccError:
                xid = 48  # a DBE event is the same finding as XID 48
            elif data.eventType == nvml.nvmlEventTypeXidCriticalError:
                xid = int(data.eventData)
            else:
                continue
            events.append(
                LiveXid(
                    index,
                    xid,
                    int(data.eventType),
                    _instance_id(getattr(data, "gpuInstanceId", None)),
                    _instance_id(getattr(data, "computeInstanceId", None)),
                )
            )
        return events

    def close(self) -> None:
        """Free the event set (errors ignored: the agent is finishing anyway)."""
        if self.event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self.event_set)
            except NVML_ERRORS:
                pass
            self.event_set = None


def _handle_key(handle: Any) -> Any:
    """Return a comparable identity of a device handle (pynvml's is a ctypes pointer)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle  # FakeNvml's handles compare by value


def _instance_id(value: Any) -> int | None:
    # NVML reports 0xFFFFFFFF for "no MIG instance".
    if value is None or int(value) == 0xFFFFFFFF:
        return None
    return int(value)


def xid_check(
    live: Sequence[LiveXid],
    logged: Sequence[KernelXid],
    unavailable: Sequence[str] = (),
) -> CheckResult:
    """Judge the XIDs of one GPU from live events and new kernel-log lines.

    ``unavailable`` names the XID sources that could not be read for this GPU; with nothing
    found the check is then unknown, never a silent pass.
    """
    findings: dict[int, dict[str, Any]] = {}
    for event in live:
        entry = findings.setdefault(event.xid, {"xid": event.xid, "sources": [], "count": 0})
        entry["count"] += 1
        if "event" not in entry["sources"]:
            entry["sources"].append("event")
        if event.gpu_instance_id is not None:
            entry.setdefault("mig", []).append({"gi": event.gpu_instance_id, "ci": event.compute_instance_id})
    for line in logged:
        entry = findings.setdefault(line.xid, {"xid": line.xid, "sources": [], "count": 0})
        entry["count"] += 1
        if "kernel_log" not in entry["sources"]:
            entry["sources"].append("kernel_log")
        entry.setdefault("detail", without_process(line.detail))
    results: list[CheckResult] = []
    for xid, entry in sorted(findings.items()):
        policy = xid_policy(xid)
        entry["meaning"] = policy.meaning
        entry["severity"] = str(policy.status)
        results.append(CheckResult("xid", policy.status, action=policy.action))
    if unavailable:
        results.append(CheckResult("xid", Status.UNKNOWN, action=Action.INVESTIGATE))
    value = [findings[xid] for xid in sorted(findings)]
    status = worst_status(results) if results else Status.PASS
    action = recommended_action(results) if results else Action.NONE
    parts = [f"XID {e['xid']} x{e['count']} ({e['meaning']})" for e in value]
    if unavailable:
        parts.append("not read: " + "; ".join(unavailable))
    message = "; ".join(parts) if parts else "no new XIDs"
    return CheckResult("xid", status, value, "see XID policy", message, action)


# --- node-level checks --------------------------------------------------------------------------


def format_cuda_version(version: int) -> str:
    """Format NVML's CUDA driver version integer (12040) as "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def check_version_pin(name: str, actual: str | None, pin: str | None, error: str | None = None) -> CheckResult:
    """Compare a driver or CUDA version with its pin; no pin means only that it is readable."""
    if actual is None:
        return CheckResult(name, Status.UNKNOWN, None, pin, f"{name} unreadable: {error}", Action.INVESTIGATE)
    if pin is None:
        return CheckResult(name, Status.PASS, actual, None, f"{actual} (no pin)")
    # "12.4" pins every 12.4.x; a full version pins exactly.
    if actual == pin or actual.startswith(pin + "."):
        return CheckResult(name, Status.PASS, actual, pin, f"{actual} matches the pin")
    return CheckResult(name, Status.WARN, actual, pin, f"{actual} differs from the pinned {pin}", Action.INVESTIGATE)


def cuda_major_minor(version: str) -> tuple[int, int] | None:
    """Return a CUDA version's (major, minor) as numbers ("12.10" is newer than "12.8"), None for no version."""
    parts = str(version).strip().split(".")
    if len(parts) < 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1])


def check_cuda_support(supported: str | None, required: str, error: str | None = None) -> CheckResult:
    """Fail when the driver cannot run the CUDA version the node's cluster chose.

    ``supported`` is the newest CUDA version the installed driver supports (NVML's
    nvmlSystemGetCudaDriverVersion, formatted "12.8"); a driver also runs every older one, so
    anything at or above ``required`` passes. Compared as numbers, major.minor.
    """
    if supported is None:
        return CheckResult(
            "cuda_support", Status.UNKNOWN, None, required,
            f"CUDA version the driver supports unreadable: {error}", Action.INVESTIGATE,
        )
    have, need = cuda_major_minor(supported), cuda_major_minor(required)
    if have is None or need is None:
        bad = supported if have is None else required
        return CheckResult(
            "cuda_support", Status.UNKNOWN, supported, required, f"{bad!r} is no CUDA version", Action.INVESTIGATE
        )
    message = f"driver supports CUDA {supported}; CUDA {required} is required"
    if have < need:
        return CheckResult("cuda_support", Status.FAIL, supported, required, message, Action.INVESTIGATE)
    return CheckResult("cuda_support", Status.PASS, supported, required, message)


def check_gpu_count(count: int | None, expected: int | None, error: str | None = None) -> CheckResult:
    """Fail when NVML enumerates another number of GPUs than the node should have (AZ, GCM, HP)."""
    if count is None:
        return CheckResult("gpu_count", Status.UNKNOWN, None, expected, f"GPU count unreadable: {error}")
    if expected is None:
        return CheckResult(
            "gpu_count", Status.UNKNOWN, count, None, "no expected GPU count for this model", Action.INVESTIGATE
        )
    if count != expected:
        return CheckResult(
            "gpu_count",
            Status.FAIL,
            count,
            expected,
            f"{count} GPUs enumerated, expected {expected}; a GPU is missing from the bus",
            Action.RESEAT,
        )
    return CheckResult("gpu_count", Status.PASS, count, expected, f"{count} GPUs")


def check_gpu_model(names: Sequence[str], requested: str | None, profile: GpuModelThresholds) -> CheckResult:
    """Check that the node's GPUs are of one profiled model, the one its pool expects."""
    distinct = sorted(set(names))
    value = {"names": distinct, "profile": profile.model}
    if len(distinct) > 1:
        return CheckResult(
            "gpu_model", Status.FAIL, value, requested, f"mixed GPU models: {distinct}", Action.INVESTIGATE
        )
    if requested is not None and distinct and not profile.matches(distinct[0]):
        return CheckResult(
            "gpu_model",
            Status.FAIL,
            value,
            requested,
            f"node has {distinct[0]}, its pool expects {requested}",
            Action.INVESTIGATE,
        )
    if not profile.profiled:
        return CheckResult(
            "gpu_model",
            Status.UNKNOWN,
            value,
            requested,
            f"no thresholds configured for {distinct[0] if distinct else 'this GPU'}",
            Action.INVESTIGATE,
        )
    return CheckResult("gpu_model", Status.PASS, value, requested or profile.model, profile.description)


def check_vbios_consistency(vbios_by_gpu: Mapping[int, str | None], errors: Sequence[str] = ()) -> CheckResult:
    """Warn when the GPUs of one node run different VBIOS versions (GCM); unreadable ones are unknown."""
    known = {index: v for index, v in vbios_by_gpu.items() if v is not None}
    versions = sorted(set(known.values()))
    unreadable = sorted(index for index, v in vbios_by_gpu.items() if v is None)
    if not known or unreadable:
        reason = f": {errors[0]}" if errors else ""
        return CheckResult(
            "vbios_consistency",
            Status.UNKNOWN,
            {str(i): v for i, v in sorted(vbios_by_gpu.items())},
            "identical",
            f"VBIOS version unreadable on {gpus_named(unreadable)}{reason}",
            Action.INVESTIGATE,
        )
    if len(versions) > 1:
        return CheckResult(
            "vbios_consistency",
            Status.WARN,
            {str(i): v for i, v in sorted(known.items())},
            "identical",
            f"VBIOS versions differ across GPUs: {versions}",
            Action.INVESTIGATE,
        )
    return CheckResult("vbios_consistency", Status.PASS, versions[0], "identical", f"all GPUs on {versions[0]}")


def unmapped_xid_check(logged: Sequence[KernelXid], unavailable: str | None) -> CheckResult:
    """Judge kernel-log XIDs that name no enumerated GPU (e.g. one that fell off the bus)."""
    if unavailable is not None:
        return CheckResult("xid_log", Status.UNKNOWN, None, None, f"kernel log unreadable: {unavailable}")
    if not logged:
        return CheckResult("xid_log", Status.PASS, [], None, "kernel log read; no XIDs outside known GPUs")
    result = xid_check([], logged)
    value = [
        {**entry, "pci": sorted({format_pci(x.pci) for x in logged if x.xid == entry["xid"]})} for entry in result.value
    ]
    return CheckResult(
        "xid_log",
        result.status,
        value,
        result.threshold,
        "XIDs from GPUs NVML cannot see: " + result.message,
        result.action,
    )
