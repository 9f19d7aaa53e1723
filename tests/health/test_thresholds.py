"""Per-model thresholds: lookup by key or NVML name, overrides from configuration."""

from __future__ import annotations

import pytest

from provisioning.health.results import Action, CheckResult, Status, recommended_action, worst_status
from provisioning.health.thresholds import (
    DEFAULT_THRESHOLDS,
    GpuModelThresholds,
    thresholds_for,
    thresholds_from_config,
)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 SXM5 80GB", "H100-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-32GB", "V100-SXM2"),
        ("H100-SXM", "H100-SXM"),
        ("h100-sxm", "H100-SXM"),
        ("a100_80gb", "A100-80GB"),
        ("l40s", "L40S"),
    ],
)
def test_lookup_by_key_or_nvml_name(name: str, model: str) -> None:
    profile = thresholds_for(name)
    assert profile is not None and profile.model == model


@pytest.mark.parametrize(
    "name",
    ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB", "NVIDIA L40", "NVIDIA GeForce RTX 4090", ""],
)
def test_other_skus_are_not_matched(name: str) -> None:
    assert thresholds_for(name) is None


def test_h100_values_come_from_the_research() -> None:
    h100 = DEFAULT_THRESHOLDS["H100-SXM"]
    assert (h100.gpus_per_node, h100.nvlink_links, h100.fabric_manager, h100.mig_capable) == (8, 18, True, True)
    assert (h100.pcie_gen_min, h100.pcie_width_min) == (3, 16)
    assert (h100.ecc_sram_corrected_warn, h100.ecc_dram_corrected_warn, h100.remap_uncorrected_fail) == (
        10_000,
        20_000_000,
        512,
    )
    assert (h100.h2d_min_gbps, h100.p2p_min_gbps, h100.nccl_busbw_min_gbps, h100.ib_write_bw_min_gbps) == (
        48.0,
        335.0,
        460.0,
        380.0,
    )
    assert DEFAULT_THRESHOLDS["L40S"].nvlink_links == 0
    assert DEFAULT_THRESHOLDS["V100-SXM2"].memory_repair == "page_retirement"


def test_overrides_update_and_add_models() -> None:
    table = thresholds_from_config(
        {
            "h100-sxm": {"nccl_busbw_min_gbps": 440.0, "driver_pin": "550.90.07"},
            "B200": {"description": "NVIDIA B200", "name_patterns": [r"\bB200\b"], "nvlink_links": 18},
        }
    )
    assert table["H100-SXM"].nccl_busbw_min_gbps == 440.0
    assert table["H100-SXM"].driver_pin == "550.90.07"
    assert DEFAULT_THRESHOLDS["H100-SXM"].nccl_busbw_min_gbps == 460.0  # defaults untouched
    b200 = thresholds_for("NVIDIA B200", table)
    assert isinstance(b200, GpuModelThresholds) and b200.model == "B200" and b200.name_patterns == (r"\bB200\b",)
    with pytest.raises(ValueError, match="nccl_busbw_min"):
        thresholds_from_config({"H100-SXM": {"nccl_busbw_min": 1}})


def test_verdict_and_action_ranking() -> None:
    checks = [
        CheckResult("a", Status.WARN, action=Action.RESEAT),
        CheckResult("b", Status.UNKNOWN, action=Action.INVESTIGATE),
        CheckResult("c", Status.PASS, action=Action.RMA),
    ]
    assert checks[2].action is Action.NONE  # a pass never asks for action
    assert worst_status(checks) is Status.UNKNOWN  # unknown outranks warn
    assert recommended_action(checks) is Action.INVESTIGATE
    checks.append(CheckResult("d", Status.FAIL, action=Action.MONITOR))
    checks.append(CheckResult("e", Status.FAIL, action=Action.REPLACE_GPU))
    assert worst_status(checks) is Status.FAIL
    assert recommended_action(checks) is Action.REPLACE_GPU  # strongest action among the failures
    assert worst_status([]) is Status.UNKNOWN  # no checks is never a pass
