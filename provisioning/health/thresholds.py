"""Per-GPU-model health thresholds (DCGM keeps them per SKU in diag-skus.yaml; Azure per VM conf).

Sources are the keys of /work/shared/research/health-checks.md. Numbers marked "proposal" have no
published source for that model: they are our first estimate, to be tuned from fleet data.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

MemoryRepair = Literal["row_remap", "page_retirement"]


@dataclass(frozen=True)
class GpuModelThresholds:
    """Everything a check needs to know about one GPU model; one instance per SKU."""

    model: str
    description: str
    # Regular expressions matched (case-insensitive, search) against NVML's device name.
    name_patterns: tuple[str, ...]
    profiled: bool = True
    gpus_per_node: int | None = 8
    # NVLink links expected active per GPU; 0 means a PCIe-only SKU (check skipped).
    nvlink_links: int = 0
    # NVSwitch fabric state (nvmlDeviceGetGpuFabricInfo) exists on Hopper+ HGX only.
    fabric_manager: bool = False
    mig_capable: bool = False
    memory_repair: MemoryRepair = "row_remap"
    ecc_expected: bool = True
    # Memory locations whose aggregate counters are judged (SRAM/DRAM split exists on Ampere+).
    ecc_locations: tuple[str, ...] = ("sram", "dram")
    # PCIe: DCGM's H100 floor is gen 3 / x16 under load (DS); links downshift when idle (BAAZ).
    pcie_gen_min: int = 3
    pcie_width_min: int = 16
    pcie_replay_warn_total: int = 80  # DCGM pcie diag limit, used when no baseline gives a rate (DP)
    pcie_replay_rate_per_min: float = 31.0  # Gen5 x16 per-lane limit x lanes (DH); applied to all SKUs
    # Temperature: warn this many degrees below NVML's slowdown threshold (proposal), fail at it (GCM).
    temp_warn_margin_c: int = 5
    # Used only when NVML will not tell the slowdown threshold: a reading above it still fails.
    temp_slowdown_fallback_c: int | None = None
    # Power: board limit expected to be enforced, and the tolerated ratios.
    power_limit_w: float | None = None
    power_limit_min_ratio: float = 0.9  # a lower enforced cap is a misconfiguration (proposal)
    power_over_limit_ratio: float = 1.05  # draw this far above the enforced limit is a warning (proposal)
    # ECC and memory repair (AZ, DSW, DH).
    ecc_sram_corrected_warn: int = 10_000
    ecc_dram_corrected_warn: int = 20_000_000
    remap_uncorrected_fail: int = 512
    retired_pages_fail: int = 63
    retired_dbe_warn: int = 15
    # NVLink CRC flit errors per second that fail a link (DH); any replay/recovery delta fails.
    nvlink_crc_fail_per_s: float = 100.0
    # Bandwidth floors, GB/s for NVLink/PCIe copies and NCCL busbw, Gb/s for ib_write_bw.
    h2d_min_gbps: float | None = None
    d2h_min_gbps: float | None = None
    p2p_min_gbps: float | None = None
    nccl_busbw_min_gbps: float | None = None
    nccl_multinode_busbw_min_gbps: float | None = None
    ib_write_bw_min_gbps: float | None = None
    # Optional fleet pins; a reservation's own CUDA choice is passed to the agent instead.
    driver_pin: str | None = None
    cuda_pin: str | None = None

    def matches(self, device_name: str) -> bool:
        """Tell whether NVML's device name belongs to this model."""
        return any(re.search(pattern, device_name, re.IGNORECASE) for pattern in self.name_patterns)


H100_SXM = GpuModelThresholds(
    model="H100-SXM",
    description="NVIDIA H100 80GB HBM3 (SXM5, HGX 8-GPU)",
    # SXM5 reports "NVIDIA H100 80GB HBM3"; PCIe and NVL variants say so and are other SKUs.
    name_patterns=(r"\bH100\b(?!.*\b(PCIe|NVL)\b).*(HBM3|SXM)",),
    gpus_per_node=8,
    nvlink_links=18,  # NV18 topology (NT, AZ)
    fabric_manager=True,
    mig_capable=True,
    pcie_gen_min=3,
    temp_slowdown_fallback_c=87,
    power_limit_w=700.0,
    h2d_min_gbps=48.0,  # Azure ND H100 v5 (AZ)
    d2h_min_gbps=48.0,
    p2p_min_gbps=335.0,
    nccl_busbw_min_gbps=460.0,  # Azure; NVIDIA expects ~480 peak (AZ, NCCL)
    nccl_multinode_busbw_min_gbps=360.0,  # proposal: 8x NDR400 per node caps inter-node busbw near 400
    ib_write_bw_min_gbps=380.0,  # NDR400 (AZ)
)

A100_80GB = GpuModelThresholds(
    model="A100-80GB",
    description="NVIDIA A100-SXM4-80GB (HGX 8-GPU)",
    name_patterns=(r"\bA100[- ]SXM4?[- ]80GB\b",),
    gpus_per_node=8,
    nvlink_links=12,
    fabric_manager=False,  # NVML's fabric state is Hopper+ only; FM health shows as NVLink state
    mig_capable=True,
    pcie_gen_min=3,
    temp_slowdown_fallback_c=89,
    power_limit_w=400.0,
    h2d_min_gbps=20.0,  # proposal: PCIe Gen4 x16 reaches ~25 GB/s
    d2h_min_gbps=20.0,
    p2p_min_gbps=230.0,  # proposal: NVLink3, 300 GB/s per direction
    nccl_busbw_min_gbps=228.0,  # proposal, Azure ND A100 v4 order of magnitude
    nccl_multinode_busbw_min_gbps=170.0,  # proposal: 8x HDR200
    ib_write_bw_min_gbps=180.0,  # proposal: HDR200
)

L40S = GpuModelThresholds(
    model="L40S",
    description="NVIDIA L40S (PCIe, no NVLink, no MIG)",
    name_patterns=(r"\bL40S\b",),
    gpus_per_node=8,
    nvlink_links=0,
    fabric_manager=False,
    mig_capable=False,
    pcie_gen_min=3,
    temp_slowdown_fallback_c=88,
    power_limit_w=350.0,
    h2d_min_gbps=20.0,  # proposal: PCIe Gen4 x16
    d2h_min_gbps=20.0,
    p2p_min_gbps=None,  # PCIe peer copies depend on the host topology; not judged
    nccl_busbw_min_gbps=15.0,  # proposal: 8 GPUs over PCIe Gen4
    nccl_multinode_busbw_min_gbps=15.0,  # proposal
    ib_write_bw_min_gbps=180.0,  # proposal: 200G NIC
)

V100_SXM2 = GpuModelThresholds(
    model="V100-SXM2",
    description="NVIDIA Tesla V100-SXM2 (pre-Ampere: page retirement instead of row remapping)",
    name_patterns=(r"\bV100[- ]SXM2\b",),
    gpus_per_node=8,
    nvlink_links=6,
    fabric_manager=False,
    mig_capable=False,
    memory_repair="page_retirement",
    ecc_locations=("dram",),
    pcie_gen_min=3,
    temp_slowdown_fallback_c=87,
    power_limit_w=300.0,
    h2d_min_gbps=10.0,  # proposal: PCIe Gen3 x16
    d2h_min_gbps=10.0,
    p2p_min_gbps=40.0,  # proposal: hybrid cube mesh, one or two NVLink2 bricks per pair
    nccl_busbw_min_gbps=120.0,  # proposal
    nccl_multinode_busbw_min_gbps=40.0,  # proposal: EDR100
    ib_write_bw_min_gbps=90.0,  # proposal: EDR100
)

# An unprofiled device (e.g. a consumer card) is still checked, but only with readings that
# mean the same on every product; results that are unreliable there become unknown (GPUD351).
GENERIC = GpuModelThresholds(
    model="unknown",
    description="no thresholds configured for this GPU model",
    name_patterns=(),
    profiled=False,
    gpus_per_node=None,
    nvlink_links=0,
    ecc_expected=False,
)

DEFAULT_THRESHOLDS: dict[str, GpuModelThresholds] = {
    profile.model: profile for profile in (H100_SXM, A100_80GB, L40S, V100_SXM2)
}


def _normalise_key(key: str) -> str:
    return re.sub(r"[^a-z0-9]", "", key.lower())


def thresholds_for(
    model_or_name: str | None, table: Mapping[str, GpuModelThresholds] | None = None
) -> GpuModelThresholds | None:
    """Return the profile for a model key ("H100-SXM", "h100-sxm") or an NVML device name.

    Return None when nothing matches; callers then fall back to GENERIC and report the model
    as unprofiled.
    """
    if not model_or_name:
        return None
    table = DEFAULT_THRESHOLDS if table is None else table
    wanted = _normalise_key(model_or_name)
    for key, profile in table.items():
        if _normalise_key(key) == wanted:
            return profile
    for profile in table.values():
        if profile.matches(model_or_name):
            return profile
    return None


def thresholds_from_config(
    overrides: Mapping[str, Mapping[str, Any]], base: Mapping[str, GpuModelThresholds] | None = None
) -> dict[str, GpuModelThresholds]:
    """Return a threshold table with per-model overrides applied (e.g. from JSON settings).

    Keys name a model (existing ones are updated field by field; new ones need at least
    "description" and "name_patterns"). Unknown field names raise ValueError, so a typo in
    configuration cannot silently keep a default.
    """
    table = dict(DEFAULT_THRESHOLDS if base is None else base)
    known = {f.name for f in dataclasses.fields(GpuModelThresholds)}
    for model, fields in overrides.items():
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"unknown threshold fields for {model}: {sorted(unknown)}")
        values = dict(fields)
        for tuple_field in ("name_patterns", "ecc_locations"):
            if tuple_field in values:
                values[tuple_field] = tuple(values[tuple_field])
        existing = thresholds_for(model, table)
        if existing is not None and _normalise_key(existing.model) == _normalise_key(model):
            table[existing.model] = dataclasses.replace(existing, **values)
        else:
            values.setdefault("model", model)
            table[model] = GpuModelThresholds(**values)
    return table
