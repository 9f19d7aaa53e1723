"""The fake NVML itself: pynvml's shapes and errors, determinism, the JSON fault description."""

from __future__ import annotations

import ctypes
import json

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provisioning.health.agent import run_checks
from provisioning.health.fake_nvml import ENV_VAR, FAULT_KINDS, FakeNvml, Fault, fake_for_host, fake_from_env
from provisioning.health.results import STATUS_RANK, Status

from .conftest import PINS, validate_report


def test_returns_pynvml_shapes_and_constants() -> None:
    fake = FakeNvml(seed=1)
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.NVML_FEATURE_ENABLED == pynvml.NVML_FEATURE_ENABLED
    assert fake.nvmlClocksEventReasonHwSlowdown == pynvml.nvmlClocksEventReasonHwSlowdown
    assert fake.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    assert fake.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    assert isinstance(fake.nvmlDeviceGetPciInfo(handle), pynvml.nvmlPciInfo_t)
    assert fake.nvmlDeviceGetRemappedRows(handle) == (0, 0, 0, 0)
    assert fake.nvmlDeviceGetMigMode(handle) == [0, 0]
    assert fake.nvmlSystemGetCudaDriverVersion() == 13000
    info = pynvml.c_nvmlGpuFabricInfo_v2_t()
    assert fake.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    assert info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetNvLinkState(handle, 18)  # H100 SXM has links 0..17
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(8)
    with pytest.raises(AttributeError):
        fake.nvmlDeviceGetBAR1MemoryInfo  # noqa: B018 - not faked: must not pass silently
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


@pytest.mark.parametrize(
    ("error", "cls"),
    [
        ("LibraryNotFound", pynvml.NVMLError_LibraryNotFound),
        ("DriverNotLoaded", pynvml.NVMLError_DriverNotLoaded),
        ("LibRmVersionMismatch", pynvml.NVMLError_LibRmVersionMismatch),
        ("NoPermission", pynvml.NVMLError_NoPermission),
    ],
)
def test_init_failures_raise_the_real_error_classes(error: str, cls: type[Exception]) -> None:
    fake = FakeNvml(faults=[Fault("init_failure", error=error)])
    with pytest.raises(cls) as raised:
        fake.nvmlInit()
    assert isinstance(raised.value, pynvml.NVMLError)


def test_lost_gpu_raises_gpu_is_lost() -> None:
    fake = FakeNvml(faults=[Fault("gpu_lost", gpu=1), Fault("fallen_off_bus", gpu=2)])
    fake.nvmlInit()
    lost = fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(lost)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(2)
    assert "): 79, " in fake.read_kernel_log()[0]


def test_the_same_seed_gives_the_same_node() -> None:
    def identity(fake: FakeNvml) -> list[tuple[str, str, int]]:
        fake.nvmlInit()
        handles = [fake.nvmlDeviceGetHandleByIndex(i) for i in range(fake.nvmlDeviceGetCount())]
        return [
            (fake.nvmlDeviceGetUUID(h), fake.nvmlDeviceGetSerial(h), fake.nvmlDeviceGetTemperature(h, 0))
            for h in handles
        ]

    assert identity(FakeNvml(seed=5)) == identity(FakeNvml(seed=5))
    assert identity(FakeNvml(seed=5)) != identity(FakeNvml(seed=6))
    uuids = [u for u, _, _ in identity(FakeNvml(seed=5))]
    assert len(set(uuids)) == 8


def test_spec_round_trip_and_validation() -> None:
    fake = FakeNvml(
        model="L40S", gpus=4, seed=3, hostname="l40s-01", faults=[Fault("xid", gpu=2, xid=79), "persistence_off"]
    )
    spec = fake.to_spec()
    assert spec == {
        "hostname": "l40s-01",
        "model": "L40S",
        "gpus": 4,
        "seed": 3,
        "faults": [{"kind": "xid", "gpu": 2, "xid": 79}, {"kind": "persistence_off"}],
    }
    again = FakeNvml.from_spec(json.dumps(spec))
    assert again.to_spec() == spec
    assert again.read_kernel_log() == fake.read_kernel_log()
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault("melted")
    with pytest.raises(ValueError, match="unknown fake NVML spec keys"):
        FakeNvml.from_spec({"modle": "H100-SXM"})
    with pytest.raises(ValueError, match="node has 4 GPUs"):
        FakeNvml(model="L40S", gpus=4, faults=[Fault("hot", gpu=4)])
    with pytest.raises(ValueError, match="pynvml has no NVMLError_Melted"):
        FakeNvml(faults=[Fault("nvml_error", call="nvmlDeviceGetName", error="Melted")])


def test_fleet_description() -> None:
    fleet = {
        "default": {"model": "H100-SXM", "faults": [{"kind": "persistence_off", "gpu": 0}]},
        "nodes": {"h100-002": [{"kind": "ecc_uncorrected", "gpu": 3}], "h100-003": {"model": "L40S", "gpus": 4}},
    }
    healthy = fake_for_host("h100-001", fleet)
    broken = fake_for_host("h100-002", json.dumps(fleet))
    other = fake_for_host("h100-003", fleet)
    assert [f.kind for f in healthy.faults] == ["persistence_off"]
    assert [f.kind for f in broken.faults] == ["persistence_off", "ecc_uncorrected"]
    assert (other.fake_model.key, len(other.gpus)) == ("L40S", 4)
    assert healthy.hostname == "h100-001"
    # hosts differ (seed from hostname) yet each is stable
    assert healthy.gpus[0].uuid != broken.gpus[0].uuid
    assert fake_for_host("h100-001", fleet).gpus[0].uuid == healthy.gpus[0].uuid
    assert fake_from_env("h100-002", {ENV_VAR: json.dumps(fleet)}).faults == broken.faults
    assert fake_from_env("h100-002", {}) is None


def test_counters_grow_between_reads() -> None:
    fake = FakeNvml(faults=[Fault("pcie_replay", gpu=0, rate=7), Fault("ecc_corrected_growing", gpu=0, rate=100)])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert [fake.nvmlDeviceGetPcieReplayCounter(handle) for _ in range(3)] == [7, 14, 21]
    args = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC, pynvml.NVML_MEMORY_LOCATION_SRAM)
    assert [fake.nvmlDeviceGetMemoryErrorCounter(handle, *args) for _ in range(2)] == [8100, 8200]


# --- property: any combination of faults gives a valid, consistent report ----------------------

SIMPLE_FAULTS = [
    kind
    for kind in FAULT_KINDS
    if kind
    not in {
        "init_failure",
        "hang",
        "nvml_error",
        "not_supported",
        "function_not_found",
        "missing_function",
        "retired_pages",
        "retired_pages_pending",
        "gpu_missing",
        "fallen_off_bus",
    }
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(st.tuples(st.sampled_from(SIMPLE_FAULTS), st.integers(0, 7)), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_any_fault_combination_gives_a_consistent_report(faults: list[tuple[str, int]], seed: int) -> None:
    fake = FakeNvml(seed=seed, faults=[Fault(kind, gpu=gpu) for kind, gpu in faults])
    report = validate_report(run_checks("quick", fake, event_wait_ms=0, **PINS))
    statuses = [report["verdict"]] + [g["verdict"] for g in report["gpus"]]
    every = [c["status"] for c in report["node_checks"]] + [c["status"] for g in report["gpus"] for c in g["checks"]]
    assert report["verdict"] == max(every, key=lambda s: STATUS_RANK[Status(s)])
    for gpu in report["gpus"]:
        assert gpu["verdict"] == max((c["status"] for c in gpu["checks"]), key=lambda s: STATUS_RANK[Status(s)])
    if not faults:
        assert set(statuses) == {"pass"}
    if report["verdict"] == "pass":
        assert report["recommended_action"] == "none" and report["problems"] == []
    else:
        assert report["recommended_action"] != "none"
