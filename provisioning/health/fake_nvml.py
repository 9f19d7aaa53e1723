"""A fake NVML: the one boundary no test machine or demo fleet has hardware for.

``FakeNvml`` exposes the pynvml functions the checks call, with pynvml's return shapes, reuses
pynvml's constants and structures, and raises the real ``pynvml.NVMLError_*`` classes. It models
one node of N identical GPUs with healthy, realistic, seed-deterministic readings, and every fault
of the research list (section c) can be injected per node or per GPU, modelled on DCGM's
nvml-injection (per function key + device/link/counter -> return code or value) (NI).

    FakeNvml(model="H100-SXM", gpus=8, faults=[Fault("ecc_uncorrected", gpu=3),
             Fault("nvlink_down", gpu=1, link=4), Fault("xid", gpu=2, xid=79)])

The same description travels as JSON (``FakeNvml.from_spec``) and a fleet simulator says which
node has which fault with ``fake_for_host(hostname, fleet)`` or the ``PORTAL_FAKE_NVML`` variable.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import threading
import time
import uuid as uuidlib
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pynvml

ENV_VAR = "PORTAL_FAKE_NVML"

# Every injectable fault, with what it does; Fault() refuses other kinds.
FAULT_KINDS: dict[str, str] = {
    # 1. init failures
    "init_failure": "nvmlInit raises error= (LibraryNotFound | DriverNotLoaded | LibRmVersionMismatch | "
    "NoPermission | Unknown)",
    # 2. device loss
    "gpu_missing": "the GPU (default: the last) is not enumerated: count N-1",
    "gpu_lost": "every query on the GPU raises GpuIsLost",
    "fallen_off_bus": "the GPU's handle raises GpuIsLost and the kernel log holds XID 79",
    "nvml_error": "call= raises error= (any NVMLError_* name), on gpu= or on all GPUs",
    "hang": "call= sleeps seconds= before answering (a hung NVML call)",
    # 3. unsupported readings
    "not_supported": "call= raises NotSupported (on gpu= or all)",
    "function_not_found": "call= raises FunctionNotFound (an old driver)",
    "missing_function": "the binding lacks call= (an old nvidia-ml-py): AttributeError",
    # 4. ECC
    "ecc_uncorrected": "volatile and aggregate uncorrected ECC errors (count=1)",
    "ecc_uncorrected_aggregate": "aggregate-only uncorrected ECC errors (count=2), from before the last reboot",
    "ecc_corrected_sram": "aggregate corrected SRAM errors above 10 000 (count=12000)",
    "ecc_corrected_dram": "aggregate corrected DRAM errors above 20 000 000 (count=25000000)",
    "ecc_corrected_growing": "corrected SRAM errors that grow by rate= (5000) at every read",
    "ecc_sram_uncorrected": "uncorrected SRAM errors (count=1)",
    "ecc_disabled": "ECC mode off: ECC counters raise NotSupported",
    # 5. memory repair
    "remap_pending": "a row remap pending (reset needed)",
    "remap_failure": "row remapping failed",
    "remap_uncorrected": "count= (512) rows remapped for uncorrectable errors",
    "retired_pages": "count= (63) retired pages, cause= dbe | sbe (pre-Ampere models)",
    "retired_pages_pending": "a page retirement pending (pre-Ampere models)",
    # 6. clocks
    "clock_event": "clock event reasons bits= (default 0x40 HW thermal slowdown)",
    # 7. temperature and power
    "hot": "temperature 3 C below the slowdown threshold",
    "overtemp": "temperature 2 C above the slowdown threshold",
    "power_over_limit": "draw 15% over the enforced power limit",
    "power_capped": "enforced power limit at 60% of the board's",
    "power_not_supported": "a board without power telemetry: nvmlDeviceGetPowerUsage and "
    "nvmlDeviceGetEnforcedPowerLimit raise NotSupported (only= usage | limit for one of them)",
    # 8. PCIe
    "pcie_degraded": "link trained at width= (8) and gen= (the max)",
    "pcie_replay": "PCIe replay counter grows by rate= (500) at every read",
    # 9. NVLink and fabric
    "nvlink_down": "link= (0) inactive",
    "nvlink_errors": "counter= (replay | recovery | crc_flit) on link= (0) grows by rate= (5) at every read",
    "fabric_incomplete": "fabric state= (in_progress | not_started) instead of completed",
    # 10. configuration
    "mig_pending": "MIG mode change pending",
    "persistence_off": "persistence mode disabled",
    "driver_mismatch": "driver version driver= (535.129.03)",
    "cuda_mismatch": "CUDA driver version cuda= (12020): off a CUDA pin (a warning), below a cluster's cuda_min "
    "(cuda_support fails)",
    "vbios_mismatch": "the GPU reports vbios= (another VBIOS version)",
    # 11. XIDs
    "xid": "XID xid= on gpu=, source= log | event | both (log), repeat= identical log lines, gi=/ci= MIG ids",
    "event_wait_error": "nvmlEventSetWait raises error= (Unknown)",
    # 12. processes
    "stray_process": "a compute process pid= (4242) holding used_mib= (1024) MiB",
}


# NVML calls that take no device handle (nor, like nvmlDeviceGetHandleByIndex, a GPU index).
NODE_CALLS = frozenset({
    "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetCount",
    "nvmlEventSetCreate", "nvmlEventSetWait", "nvmlEventSetFree",
})


# The power readings, by the name power_not_supported's only= gives them.
POWER_CALLS: dict[str, str] = {"usage": "nvmlDeviceGetPowerUsage", "limit": "nvmlDeviceGetEnforcedPowerLimit"}


class Fault:
    """One injected fault: a kind from FAULT_KINDS, an optional GPU index and parameters."""

    __slots__ = ("kind", "gpu", "params")

    def __init__(self, kind: str, gpu: int | None = None, **params: Any) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {sorted(FAULT_KINDS)}")
        if gpu is not None and params.get("call") in NODE_CALLS:
            # These calls name no GPU: a per-GPU fault on one would never fire and a test using it
            # would pass without testing anything.
            raise ValueError(f"{params['call']} takes no GPU; drop gpu= to make every call of it fail")
        self.kind = kind
        self.gpu = gpu
        self.params = dict(params)

    def get(self, key: str, default: Any = None) -> Any:
        """Return a parameter of the fault."""
        return self.params.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form: {"kind": ..., "gpu": ..., **params}."""
        data: dict[str, Any] = {"kind": self.kind}
        if self.gpu is not None:
            data["gpu"] = self.gpu
        data.update(self.params)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str | Fault) -> Fault:
        """Build a fault from its JSON form, or from a bare kind name."""
        if isinstance(data, Fault):
            return data
        if isinstance(data, str):
            return cls(data)
        values = dict(data)
        kind = values.pop("kind")
        gpu = values.pop("gpu", None)
        return cls(kind, gpu, **values)

    def __repr__(self) -> str:
        params = "".join(f", {k}={v!r}" for k, v in self.params.items())
        gpu = f", gpu={self.gpu}" if self.gpu is not None else ""
        return f"Fault({self.kind!r}{gpu}{params})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fault) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))


@dataclass(frozen=True)
class FakeModel:
    """Static facts of one simulated GPU model (typical values seen on real boards)."""

    key: str
    name: str
    vbios: str
    nvlinks: int
    pcie_gen: int
    power_limit_w: int
    idle_power_w: tuple[int, int]
    slowdown_c: int
    shutdown_c: int
    idle_temp_c: tuple[int, int]
    mig: bool
    fabric: bool
    memory_repair: str  # row_remap | page_retirement | zeros (success with nothing behind it)
    ecc: bool
    serial: bool
    pci_device_id: int
    pci_buses: tuple[int, ...]
    default_gpus: int = 8


FAKE_MODELS: dict[str, FakeModel] = {
    "H100-SXM": FakeModel(
        key="H100-SXM",
        name="NVIDIA H100 80GB HBM3",
        vbios="96.00.99.00.01",
        nvlinks=18,
        pcie_gen=5,
        power_limit_w=700,
        idle_power_w=(68, 78),
        slowdown_c=87,
        shutdown_c=92,
        idle_temp_c=(28, 38),
        mig=True,
        fabric=True,
        memory_repair="row_remap",
        ecc=True,
        serial=True,
        pci_device_id=0x233010DE,
        pci_buses=(0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB),
    ),
    "A100-80GB": FakeModel(
        key="A100-80GB",
        name="NVIDIA A100-SXM4-80GB",
        vbios="92.00.45.00.03",
        nvlinks=12,
        pcie_gen=4,
        power_limit_w=400,
        idle_power_w=(55, 65),
        slowdown_c=89,
        shutdown_c=92,
        idle_temp_c=(27, 36),
        mig=True,
        fabric=False,
        memory_repair="row_remap",
        ecc=True,
        serial=True,
        pci_device_id=0x20B210DE,
        pci_buses=(0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD),
    ),
    "L40S": FakeModel(
        key="L40S",
        name="NVIDIA L40S",
        vbios="95.02.66.00.02",
        nvlinks=0,
        pcie_gen=4,
        power_limit_w=350,
        idle_power_w=(30, 36),
        slowdown_c=88,
        shutdown_c=94,
        idle_temp_c=(26, 34),
        mig=False,
        fabric=False,
        memory_repair="row_remap",
        ecc=True,
        serial=True,
        pci_device_id=0x26B910DE,
        pci_buses=(0x01, 0x21, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1),
    ),
    "V100-SXM2": FakeModel(
        key="V100-SXM2",
        name="Tesla V100-SXM2-32GB",
        vbios="88.00.98.00.01",
        nvlinks=6,
        pcie_gen=3,
        power_limit_w=300,
        idle_power_w=(40, 48),
        slowdown_c=87,
        shutdown_c=90,
        idle_temp_c=(30, 38),
        mig=False,
        fabric=False,
        memory_repair="page_retirement",
        ecc=True,
        serial=True,
        pci_device_id=0x1DB510DE,
        pci_buses=(0x1A, 0x1C, 0x1D, 0x1E, 0x3D, 0x3F, 0x40, 0x41),
    ),
    # An unprofiled consumer card: no ECC, no serial, and remapped rows answered with zeros (GPUD351).
    "RTX-4090": FakeModel(
        key="RTX-4090",
        name="NVIDIA GeForce RTX 4090",
        vbios="95.02.3C.00.8E",
        nvlinks=0,
        pcie_gen=4,
        power_limit_w=450,
        idle_power_w=(20, 30),
        slowdown_c=90,
        shutdown_c=97,
        idle_temp_c=(30, 40),
        mig=False,
        fabric=False,
        memory_repair="zeros",
        ecc=False,
        serial=False,
        pci_device_id=0x268410DE,
        pci_buses=(0x01, 0x21, 0x41, 0x61),
        default_gpus=1,
    ),
}

# A current driver (R580) whose CUDA support (13.0) covers every CUDA version the portal offers, so a healthy
# simulated node passes any cluster's (check cuda_support); the cuda_mismatch fault gives an older one.
DEFAULT_DRIVER = "580.82.07"
DEFAULT_CUDA = 13000

XID_TEXT: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
    31: "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_b0000000. "
    "Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    43: "Ch 00000008",
    45: "Ch 00000009",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, "
    "subpartition 0.",
    63: "Row Remapper: New row (0x00000000004e8f20) marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to remap row (0x00000000004e8f20); no spare rows available.",
    68: "NVDEC0 Exception: Err Code 0x00000002",
    74: "NVLink: fatal error detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate detected",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    109: "Ch 00000010, errorString CTX SWITCH TIMEOUT, Info 0x1c004",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) "
    "(0x20800a4c 0x4).",
    120: "GSP task timeout @ pc:0x4bd36ec, task: 1",
    140: "An uncorrectable ECC error detected (possible firmware handling failure) DRAM:-1840691462, LTC:0, "
    "MMU:0, PCIE:0",
}

_NO_INSTANCE = 0xFFFFFFFF


def _error(name: str) -> pynvml.NVMLError:
    """Return an instance of the real pynvml error class named "NotSupported" or "NVMLError_NotSupported"."""
    class_name = name if name.startswith("NVMLError_") else f"NVMLError_{name}"
    cls = getattr(pynvml, class_name, None)
    if cls is None:
        raise ValueError(f"pynvml has no {class_name}")
    return cls()


def resolve_model(model: str) -> FakeModel:
    """Return the fake model for a key like "H100-SXM" (case and punctuation ignored)."""
    wanted = "".join(ch for ch in model.lower() if ch.isalnum())
    for key, fake in FAKE_MODELS.items():
        if "".join(ch for ch in key.lower() if ch.isalnum()) == wanted:
            return fake
    raise ValueError(f"unknown fake GPU model {model!r}; known: {sorted(FAKE_MODELS)}")


@dataclass
class FakeGpu:
    """The simulated state of one physical GPU."""

    index: int
    uuid: str
    serial: str
    pci: tuple[int, int, int]
    vbios: str
    temp_c: int
    power_mw: int
    power_limit_mw: int
    pcie_gen: int
    pcie_width: int
    max_pcie_gen: int
    max_pcie_width: int = 16
    persistence: int = pynvml.NVML_FEATURE_ENABLED
    ecc_mode: tuple[int, int] = (pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_ENABLED)
    total_ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    memory_errors: dict[tuple[int, int, int], int] = field(default_factory=dict)
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    retired_pages: dict[int, list[int]] = field(default_factory=dict)
    retired_pending: int = 0
    clock_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    pcie_replay: int = 0
    nvlink_state: list[int] = field(default_factory=list)
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    fabric_state: int = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    fabric_status: int = pynvml.NVML_SUCCESS
    mig_mode: tuple[int, int] = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
    processes: list[dict[str, int]] = field(default_factory=list)
    lost: bool = False
    handle_lost: bool = False
    missing: bool = False
    # Counters that grow at every read: key -> increment.
    growth: dict[Any, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeHandle:
    """The fake's device handle (pynvml's is an opaque pointer; nothing reads inside it)."""

    physical_index: int


@dataclass
class FakeEventData:
    """The shape of pynvml's c_nvmlEventData_t that checks read (hence its camelCase fields)."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = _NO_INSTANCE
    computeInstanceId: int = _NO_INSTANCE


@dataclass
class FakeEventSet:
    """An event set: which GPUs are registered for which event types."""

    registered: dict[int, int] = field(default_factory=dict)


class FakeNvml:
    """A node of simulated GPUs behind pynvml's (camelCase) function names; see the module docstring."""

    def __init__(
        self,
        model: str = "H100-SXM",
        gpus: int | None = None,
        faults: Iterable[Fault | Mapping[str, Any] | str] = (),
        seed: int = 0,
        hostname: str = "fake-gpu-node",
        driver: str = DEFAULT_DRIVER,
        cuda: int = DEFAULT_CUDA,
    ) -> None:
        self.fake_model = resolve_model(model)
        self.hostname = hostname
        self.seed = seed
        self.faults = [Fault.from_dict(f) for f in faults]
        self.driver = driver
        self.cuda = cuda
        self.call_counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._init_count = 0
        self._init_error: str | None = None
        self._errors: dict[tuple[str, int | None], str] = {}
        self._slow: dict[tuple[str, int | None], float] = {}
        self._missing_functions: set[str] = set()
        self._events: list[FakeEventData] = []
        self._event_wait_error: str | None = None
        self._kernel_log: list[str] = []
        rng = random.Random(seed)
        count = gpus if gpus is not None else self.fake_model.default_gpus
        self._boot_s = rng.uniform(600.0, 86_400.0)
        self.gpus = [self._make_gpu(i, rng) for i in range(count)]
        for fault in self.faults:
            self._apply(fault, rng)

    # --- construction -------------------------------------------------------------------------

    def _make_gpu(self, index: int, rng: random.Random) -> FakeGpu:
        m = self.fake_model
        buses = m.pci_buses
        bus = buses[index] if index < len(buses) else (buses[-1] + index) % 256
        lo, hi = m.idle_power_w
        gpu = FakeGpu(
            index=index,
            uuid="GPU-" + str(uuidlib.UUID(int=rng.getrandbits(128), version=4)),
            serial=f"{1650000000000 + rng.randrange(10**10):013d}",
            pci=(0, bus, 0),
            vbios=m.vbios,
            temp_c=rng.randint(*m.idle_temp_c),
            power_mw=rng.randint(lo * 1000, hi * 1000),
            power_limit_mw=m.power_limit_w * 1000,
            pcie_gen=m.pcie_gen,
            pcie_width=16,
            max_pcie_gen=m.pcie_gen,
            nvlink_state=[pynvml.NVML_FEATURE_ENABLED] * m.nvlinks,
        )
        # Healthy boards still show a few corrected errors over their life.
        gpu.memory_errors[
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC, pynvml.NVML_MEMORY_LOCATION_DRAM)
        ] = rng.randint(0, 3)
        if m.mig:
            gpu.mig_mode = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
        return gpu

    def _target(self, fault: Fault) -> list[FakeGpu]:
        if fault.gpu is None:
            return list(self.gpus)
        if not 0 <= fault.gpu < len(self.gpus):
            raise ValueError(f"{fault!r}: node has {len(self.gpus)} GPUs")
        return [self.gpus[fault.gpu]]

    def _apply(self, fault: Fault, rng: random.Random) -> None:
        kind = fault.kind
        gpus = self._target(fault)
        one = gpus[0] if fault.gpu is not None else None
        single = one or self.gpus[-1]
        uncorrected, corrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
        sram, dram = pynvml.NVML_MEMORY_LOCATION_SRAM, pynvml.NVML_MEMORY_LOCATION_DRAM
        if kind == "init_failure":
            self._init_error = fault.get("error", "DriverNotLoaded")
            _error(self._init_error)  # validate the name now, not at nvmlInit
        elif kind == "gpu_missing":
            single.missing = True
        elif kind == "gpu_lost":
            for gpu in gpus:
                gpu.lost = True
        elif kind == "fallen_off_bus":
            single.handle_lost = True
            self._log_xid(single, 79, rng)
        elif kind in ("nvml_error", "not_supported", "function_not_found"):
            error = {"not_supported": "NotSupported", "function_not_found": "FunctionNotFound"}.get(
                kind, fault.get("error", "Unknown")
            )
            _error(error)
            self._errors[(fault.get("call"), fault.gpu)] = error
        elif kind == "missing_function":
            self._missing_functions.add(fault.get("call"))
        elif kind == "hang":
            self._slow[(fault.get("call"), fault.gpu)] = float(fault.get("seconds", 30.0))
        elif kind == "ecc_uncorrected":
            for gpu in gpus:
                count = int(fault.get("count", 1))
                gpu.total_ecc[(uncorrected, volatile)] = count
                gpu.total_ecc[(uncorrected, aggregate)] = count
                gpu.memory_errors[(uncorrected, volatile, dram)] = count
                gpu.memory_errors[(uncorrected, aggregate, dram)] = count
        elif kind == "ecc_uncorrected_aggregate":
            for gpu in gpus:
                gpu.total_ecc[(uncorrected, aggregate)] = int(fault.get("count", 2))
        elif kind == "ecc_corrected_sram":
            for gpu in gpus:
                gpu.memory_errors[(corrected, aggregate, sram)] = int(fault.get("count", 12_000))
        elif kind == "ecc_corrected_dram":
            for gpu in gpus:
                gpu.memory_errors[(corrected, aggregate, dram)] = int(fault.get("count", 25_000_000))
        elif kind == "ecc_corrected_growing":
            for gpu in gpus:
                gpu.memory_errors[(corrected, aggregate, sram)] = int(fault.get("start", 8_000))
                gpu.growth[("memory", corrected, aggregate, sram)] = int(fault.get("rate", 5_000))
        elif kind == "ecc_sram_uncorrected":
            for gpu in gpus:
                count = int(fault.get("count", 1))
                gpu.memory_errors[(uncorrected, aggregate, sram)] = count
        elif kind == "ecc_disabled":
            for gpu in gpus:
                gpu.ecc_mode = (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_DISABLED)
        elif kind == "remap_pending":
            for gpu in gpus:
                gpu.remapped_rows = (0, 1, 1, 0)
        elif kind == "remap_failure":
            for gpu in gpus:
                gpu.remapped_rows = (0, 0, 0, 1)
        elif kind == "remap_uncorrected":
            for gpu in gpus:
                gpu.remapped_rows = (0, int(fault.get("count", 512)), 0, 0)
        elif kind == "retired_pages":
            cause = (
                pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
                if fault.get("cause", "dbe") == "sbe"
                else pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            )
            for gpu in gpus:
                gpu.retired_pages[cause] = [0x10_0000 + 0x1000 * i for i in range(int(fault.get("count", 63)))]
        elif kind == "retired_pages_pending":
            for gpu in gpus:
                gpu.retired_pending = 1
        elif kind == "clock_event":
            for gpu in gpus:
                gpu.clock_reasons = int(fault.get("bits", pynvml.nvmlClocksEventReasonHwThermalSlowdown))
        elif kind == "hot":
            for gpu in gpus:
                gpu.temp_c = self.fake_model.slowdown_c - 3
        elif kind == "overtemp":
            for gpu in gpus:
                gpu.temp_c = self.fake_model.slowdown_c + 2
        elif kind == "power_over_limit":
            for gpu in gpus:
                gpu.power_mw = int(gpu.power_limit_mw * 1.15)
        elif kind == "power_capped":
            for gpu in gpus:
                gpu.power_limit_mw = int(gpu.power_limit_mw * 0.6)
        elif kind == "power_not_supported":
            only = fault.get("only")
            calls = POWER_CALLS if only is None else {k: v for k, v in POWER_CALLS.items() if k == only}
            if not calls:
                raise ValueError(f"{fault!r}: only= must be one of {sorted(POWER_CALLS)}")
            for call in calls.values():
                self._errors[(call, fault.gpu)] = "NotSupported"
        elif kind == "pcie_degraded":
            for gpu in gpus:
                gpu.pcie_width = int(fault.get("width", 8))
                gpu.pcie_gen = int(fault.get("gen", gpu.max_pcie_gen))
        elif kind == "pcie_replay":
            for gpu in gpus:
                gpu.growth["pcie_replay"] = int(fault.get("rate", 500))
        elif kind == "nvlink_down":
            for gpu in gpus:
                gpu.nvlink_state[int(fault.get("link", 0))] = pynvml.NVML_FEATURE_DISABLED
        elif kind == "nvlink_errors":
            counter = {
                "replay": pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                "recovery": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                "crc_flit": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            }[fault.get("counter", "replay")]
            for gpu in gpus:
                gpu.growth[("nvlink", int(fault.get("link", 0)), counter)] = int(fault.get("rate", 5))
        elif kind == "fabric_incomplete":
            state = {
                "in_progress": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
                "not_started": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
            }[fault.get("state", "in_progress")]
            for gpu in gpus:
                gpu.fabric_state = state
        elif kind == "mig_pending":
            for gpu in gpus:
                gpu.mig_mode = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE)
        elif kind == "persistence_off":
            for gpu in gpus:
                gpu.persistence = pynvml.NVML_FEATURE_DISABLED
        elif kind == "driver_mismatch":
            self.driver = str(fault.get("driver", "535.129.03"))
        elif kind == "cuda_mismatch":
            self.cuda = int(fault.get("cuda", 12020))
        elif kind == "vbios_mismatch":
            single.vbios = str(fault.get("vbios", "96.00.74.00.0B"))
        elif kind == "xid":
            xid = int(fault.get("xid", 79))
            source = fault.get("source", "log")
            for gpu in gpus:
                if source in ("log", "both"):
                    self._log_xid(gpu, xid, rng, repeat=int(fault.get("repeat", 1)))
                if source in ("event", "both"):
                    self._events.append(
                        FakeEventData(
                            FakeHandle(gpu.index),
                            pynvml.nvmlEventTypeXidCriticalError,
                            xid,
                            int(fault.get("gi", _NO_INSTANCE)),
                            int(fault.get("ci", _NO_INSTANCE)),
                        )
                    )
        elif kind == "event_wait_error":
            self._event_wait_error = fault.get("error", "Unknown")
            _error(self._event_wait_error)
        elif kind == "stray_process":
            for gpu in gpus:
                gpu.processes.append({"pid": int(fault.get("pid", 4242)), "used_mib": int(fault.get("used_mib", 1024))})

    def _log_xid(self, gpu: FakeGpu, xid: int, rng: random.Random, repeat: int = 1) -> None:
        self._boot_s += rng.uniform(1.0, 600.0)
        pid = (
            "pid='<unknown>', name=<unknown>"
            if xid in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140)
            else (f"pid={rng.randint(2000, 90000)}, name=python3")
        )
        domain, bus, device = gpu.pci
        text = XID_TEXT.get(xid, "Unspecified error")
        line = f"[{self._boot_s:>12.6f}] NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{device:02x}): {xid}, {pid}, {text}"
        self._kernel_log.extend([line] * max(1, repeat))

    # --- spec (JSON) ----------------------------------------------------------------------------

    def to_spec(self) -> dict[str, Any]:
        """Return the JSON description this fake was (or could have been) built from."""
        return {
            "hostname": self.hostname,
            "model": self.fake_model.key,
            "gpus": len(self.gpus),
            "seed": self.seed,
            "faults": [f.to_dict() for f in self.faults],
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | str, hostname: str | None = None) -> FakeNvml:
        """Build a fake from {"model", "gpus", "seed", "hostname", "driver", "cuda", "faults": [...]}.

        ``spec`` may be the JSON text. Faults are dicts ({"kind": "xid", "gpu": 2, "xid": 79}) or
        bare kind names. The seed defaults to a hash of the hostname, so each simulated node is
        different but stable.
        """
        data = json.loads(spec) if isinstance(spec, str) else dict(spec)
        unknown = set(data) - {"model", "gpus", "seed", "hostname", "driver", "cuda", "faults"}
        if unknown:
            raise ValueError(f"unknown fake NVML spec keys: {sorted(unknown)}")
        host = hostname or data.get("hostname") or "fake-gpu-node"
        return cls(
            model=data.get("model", "H100-SXM"),
            gpus=data.get("gpus"),
            faults=data.get("faults", ()),
            seed=int(data.get("seed", zlib.crc32(host.encode()))),
            hostname=host,
            driver=str(data.get("driver", DEFAULT_DRIVER)),
            cuda=int(data.get("cuda", DEFAULT_CUDA)),
        )

    # --- the agent's hooks ------------------------------------------------------------------------

    def read_kernel_log(self) -> list[str]:
        """Return the simulated node's kernel log (the agent reads it instead of dmesg)."""
        return list(self._kernel_log)

    # --- attribute plumbing -----------------------------------------------------------------------

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "_missing_functions"):
            raise AttributeError(f"this nvidia-ml-py has no {name}")
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        # Constants, structures and error classes come from pynvml itself; functions must be faked.
        value = getattr(pynvml, name)
        if inspect.isfunction(value):
            raise AttributeError(f"FakeNvml does not implement {name}")
        return value

    def _enter(self, call: str, handle: FakeHandle | None = None, gpu_index: int | None = None) -> FakeGpu | None:
        """Apply the fault table to one call: init state, hangs, lost GPUs, injected errors.

        ``gpu_index`` names the GPU of a call that takes no handle (nvmlDeviceGetHandleByIndex),
        so per-GPU faults on it apply.
        """
        with self._lock:
            self.call_counts[call] += 1
        if self._init_count <= 0:
            raise _error("Uninitialized")
        gpu = self.gpus[handle.physical_index] if handle is not None else None
        key_gpu = gpu.index if gpu is not None else gpu_index
        delay = self._slow.get((call, key_gpu), self._slow.get((call, None)))
        if delay:
            time.sleep(delay)
        if gpu is not None and gpu.lost:
            raise _error("GpuIsLost")
        error = self._errors.get((call, key_gpu), self._errors.get((call, None)))
        if error:
            raise _error(error)
        return gpu

    def _gpu(self, call: str, handle: FakeHandle) -> FakeGpu:
        gpu = self._enter(call, handle)
        assert gpu is not None
        return gpu

    @staticmethod
    def _grow(gpu: FakeGpu, key: Any, current: int) -> int:
        return current + gpu.growth.get(key, 0)

    # --- library ----------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """Initialise, or raise the injected init failure."""
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        """Initialise with flags (ignored)."""
        with self._lock:
            self.call_counts["nvmlInit"] += 1
        if self._init_error:
            raise _error(self._init_error)
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        """Release one initialisation."""
        self._enter("nvmlShutdown")
        self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        """Return the driver version string."""
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        """Return the CUDA driver version as an integer (12040 = 12.4)."""
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        """Return how many GPUs are enumerated."""
        self._enter("nvmlDeviceGetCount")
        return len(self._visible())

    def _visible(self) -> list[FakeGpu]:
        return [gpu for gpu in self.gpus if not gpu.missing]

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        """Return the handle of an enumerated GPU."""
        visible = self._visible()
        in_range = 0 <= index < len(visible)
        self._enter("nvmlDeviceGetHandleByIndex", gpu_index=visible[index].index if in_range else None)
        if not in_range:
            raise _error("InvalidArgument")
        gpu = visible[index]
        if gpu.handle_lost:
            raise _error("GpuIsLost")
        return FakeHandle(gpu.index)

    # --- identity ---------------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        """Return the product name."""
        self._gpu("nvmlDeviceGetName", handle)
        return self.fake_model.name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        """Return the GPU UUID."""
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetSerial(self, handle: FakeHandle) -> str:
        """Return the board serial (NotSupported on consumer cards)."""
        gpu = self._gpu("nvmlDeviceGetSerial", handle)
        if not self.fake_model.serial:
            raise _error("NotSupported")
        return gpu.serial

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        """Return the enumeration index of a GPU."""
        gpu = self._gpu("nvmlDeviceGetIndex", handle)
        return self._visible().index(gpu)

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> Any:
        """Return a real pynvml nvmlPciInfo_t."""
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        info = pynvml.nvmlPciInfo_t()
        info.domain, info.bus, info.device = gpu.pci
        info.pciDeviceId = self.fake_model.pci_device_id
        info.busId = f"{gpu.pci[0]:08x}:{gpu.pci[1]:02x}:{gpu.pci[2]:02x}.0".upper().encode()
        return info

    def nvmlDeviceGetVbiosVersion(self, handle: FakeHandle) -> str:
        """Return the VBIOS version."""
        return self._gpu("nvmlDeviceGetVbiosVersion", handle).vbios

    # --- settings ---------------------------------------------------------------------------------

    def nvmlDeviceGetPersistenceMode(self, handle: FakeHandle) -> int:
        """Return NVML_FEATURE_ENABLED or _DISABLED."""
        return self._gpu("nvmlDeviceGetPersistenceMode", handle).persistence

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        """Return [current, pending] MIG mode."""
        gpu = self._gpu("nvmlDeviceGetMigMode", handle)
        if not self.fake_model.mig:
            raise _error("NotSupported")
        return list(gpu.mig_mode)

    def nvmlDeviceGetEccMode(self, handle: FakeHandle) -> list[int]:
        """Return [current, pending] ECC mode."""
        gpu = self._gpu("nvmlDeviceGetEccMode", handle)
        if not self.fake_model.ecc:
            raise _error("NotSupported")
        return list(gpu.ecc_mode)

    # --- memory errors ------------------------------------------------------------------------------

    def _ecc_gpu(self, call: str, handle: FakeHandle) -> FakeGpu:
        gpu = self._gpu(call, handle)
        if not self.fake_model.ecc or gpu.ecc_mode[0] != pynvml.NVML_FEATURE_ENABLED:
            raise _error("NotSupported")  # ECC counters need ECC on (NVMLE)
        return gpu

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        """Return the total ECC count of one type and counter."""
        gpu = self._ecc_gpu("nvmlDeviceGetTotalEccErrors", handle)
        return gpu.total_ecc.get((error_type, counter_type), 0)

    def nvmlDeviceGetMemoryErrorCounter(
        self, handle: FakeHandle, error_type: int, counter_type: int, location: int
    ) -> int:
        """Return the ECC count of one memory location."""
        gpu = self._ecc_gpu("nvmlDeviceGetMemoryErrorCounter", handle)
        key = (error_type, counter_type, location)
        with self._lock:
            gpu.memory_errors[key] = self._grow(gpu, ("memory", *key), gpu.memory_errors.get(key, 0))
            return gpu.memory_errors[key]

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        """Return (correctable, uncorrectable, pending, failure) remapped rows."""
        gpu = self._gpu("nvmlDeviceGetRemappedRows", handle)
        if self.fake_model.memory_repair == "page_retirement":
            raise _error("NotSupported")
        return gpu.remapped_rows  # "zeros" models answer success with nothing behind it (GPUD351)

    def nvmlDeviceGetRetiredPages(self, handle: FakeHandle, cause: int) -> list[int]:
        """Return the addresses of pages retired for one cause."""
        gpu = self._gpu("nvmlDeviceGetRetiredPages", handle)
        if self.fake_model.memory_repair != "page_retirement":
            raise _error("NotSupported")
        return list(gpu.retired_pages.get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        """Return 1 while a page retirement waits for a reset."""
        gpu = self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if self.fake_model.memory_repair != "page_retirement":
            raise _error("NotSupported")
        return gpu.retired_pending

    # --- clocks, thermals, power --------------------------------------------------------------------

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        """Return the clock event reason bitmask."""
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        """Return the same bitmask under its pre-535 name."""
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_reasons

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        """Return the GPU temperature in C."""
        return self._gpu("nvmlDeviceGetTemperature", handle).temp_c

    def nvmlDeviceGetTemperatureV(self, handle: FakeHandle, sensor: int, version: int = 0) -> int:
        """Return the GPU temperature in C (versioned API)."""
        return self._gpu("nvmlDeviceGetTemperatureV", handle).temp_c

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeHandle, threshold: int) -> int:
        """Return a temperature threshold in C."""
        self._gpu("nvmlDeviceGetTemperatureThreshold", handle)
        m = self.fake_model
        values = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: m.slowdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: m.shutdown_c,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: m.slowdown_c - 2,
        }
        if threshold not in values:
            raise _error("NotSupported")
        return values[threshold]

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        """Return the power draw in mW."""
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        """Return the enforced power limit in mW."""
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    # --- PCIe -------------------------------------------------------------------------------------

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        """Return the current PCIe generation."""
        return self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", handle).pcie_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        """Return the current PCIe width."""
        return self._gpu("nvmlDeviceGetCurrPcieLinkWidth", handle).pcie_width

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        """Return the maximum PCIe generation of GPU and slot."""
        return self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", handle).max_pcie_gen

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        """Return the maximum PCIe width of GPU and slot."""
        return self._gpu("nvmlDeviceGetMaxPcieLinkWidth", handle).max_pcie_width

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        """Return the PCIe replay counter (grows at every read under a pcie_replay fault)."""
        gpu = self._gpu("nvmlDeviceGetPcieReplayCounter", handle)
        with self._lock:
            gpu.pcie_replay = self._grow(gpu, "pcie_replay", gpu.pcie_replay)
            return gpu.pcie_replay

    # --- NVLink and fabric ------------------------------------------------------------------------

    def _link(self, call: str, handle: FakeHandle, link: int) -> FakeGpu:
        gpu = self._gpu(call, handle)
        if not self.fake_model.nvlinks:
            raise _error("NotSupported")
        if not 0 <= link < self.fake_model.nvlinks:
            raise _error("InvalidArgument")
        return gpu

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        """Return NVML_FEATURE_ENABLED when the link is active."""
        return self._link("nvmlDeviceGetNvLinkState", handle, link).nvlink_state[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: FakeHandle, link: int, counter: int) -> int:
        """Return one NVLink error counter (grows at every read under an nvlink_errors fault)."""
        gpu = self._link("nvmlDeviceGetNvLinkErrorCounter", handle, link)
        with self._lock:
            value = self._grow(gpu, ("nvlink", link, counter), gpu.nvlink_errors.get((link, counter), 0))
            gpu.nvlink_errors[(link, counter)] = value
            return value

    def _fabric(self, call: str, handle: FakeHandle, info_ref: Any) -> int:
        gpu = self._gpu(call, handle)
        if not self.fake_model.fabric:
            raise _error("NotSupported")
        info = getattr(info_ref, "_obj", info_ref)  # ctypes.byref(struct) or the struct itself
        info.state = gpu.fabric_state
        info.status = gpu.fabric_status
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, handle: FakeHandle, info_ref: Any) -> int:
        """Fill a c_nvmlGpuFabricInfo_v2_t passed by reference."""
        return self._fabric("nvmlDeviceGetGpuFabricInfoV", handle, info_ref)

    def nvmlDeviceGetGpuFabricInfo(self, handle: FakeHandle, info_ref: Any) -> int:
        """Fill a c_nvmlGpuFabricInfo_t passed by reference."""
        return self._fabric("nvmlDeviceGetGpuFabricInfo", handle, info_ref)

    # --- processes --------------------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        """Return pynvml-style friendly objects with pid and usedGpuMemory (bytes)."""
        gpu = self._gpu("nvmlDeviceGetComputeRunningProcesses", handle)
        return [
            pynvml.nvmlFriendlyObject(
                {
                    "pid": p["pid"],
                    "usedGpuMemory": p["used_mib"] * 1024 * 1024,
                    "gpuInstanceId": _NO_INSTANCE,
                    "computeInstanceId": _NO_INSTANCE,
                }
            )
            for p in gpu.processes
        ]

    # --- events -----------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> FakeEventSet:
        """Return a new, empty event set."""
        self._enter("nvmlEventSetCreate")
        return FakeEventSet()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        """Register a GPU for some event types."""
        gpu = self._gpu("nvmlDeviceRegisterEvents", handle)
        event_set.registered[gpu.index] = event_set.registered.get(gpu.index, 0) | int(event_types)

    def nvmlEventSetWait(self, event_set: FakeEventSet, timeout_ms: int) -> FakeEventData:
        """Return the next queued event of a registered GPU, else raise Timeout (without sleeping)."""
        self._enter("nvmlEventSetWait")
        if self._event_wait_error:
            raise _error(self._event_wait_error)
        with self._lock:
            for position, event in enumerate(self._events):
                mask = event_set.registered.get(event.device.physical_index, 0)
                if mask & event.eventType:
                    return self._events.pop(position)  # delivered once, as NVML does
        raise _error("Timeout")

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        """Free an event set."""
        self._enter("nvmlEventSetFree")
        event_set.registered.clear()


def fake_for_host(hostname: str, fleet: Mapping[str, Any] | str) -> FakeNvml:
    """Build the fake of one node of a simulated fleet.

    ``fleet`` (or its JSON text) is {"default": {node spec}, "nodes": {hostname: {node spec} or
    [faults]}}; a plain node spec (no "nodes" key) applies to every host. Unlisted hosts get the
    default, healthy unless the default lists faults.
    """
    data = json.loads(fleet) if isinstance(fleet, str) else dict(fleet)
    if "nodes" not in data and "default" not in data:
        return FakeNvml.from_spec(data, hostname=hostname)
    spec = dict(data.get("default") or {})
    node = (data.get("nodes") or {}).get(hostname)
    if isinstance(node, list):
        node = {"faults": node}
    if node:
        faults = list(spec.get("faults", [])) + list(node.get("faults", []))
        spec.update(node)
        spec["faults"] = faults
    spec.pop("hostname", None)
    return FakeNvml.from_spec(spec, hostname=hostname)


def fake_from_env(hostname: str, environ: Mapping[str, str] | None = None) -> FakeNvml | None:
    """Return the fake described by PORTAL_FAKE_NVML for this host, or None when it is unset."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR)
    if not text:
        return None
    return fake_for_host(hostname, text)
