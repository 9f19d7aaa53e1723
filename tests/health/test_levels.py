"""Medium and full levels: tools absent => unknown and listed; stub tools => parsed and judged."""

from __future__ import annotations

from typing import Any

import pytest

from provisioning.health.agent import run_checks
from provisioning.health.fake_nvml import FakeNvml, Fault

from .conftest import CAT, DATA, PINS, ToolBox, check, validate_report

MEDIUM_PARTS = ["dcgm_diag", "nvbandwidth", "nccl_all_reduce"]
FULL_PARTS = MEDIUM_PARTS + ["ib_write_bw", "nccl_multi_node"]


def run(level: str, fake: FakeNvml | None = None, **kwargs: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"event_wait_ms": 0, **PINS, **kwargs}
    return validate_report(run_checks(level, fake or FakeNvml(seed=4, hostname="gpu-h100-001"), **options))


def install_healthy(toolbox: ToolBox) -> None:
    toolbox.install("dcgmi", "dcgmi_diag_r2_pass.json")
    toolbox.install("nvbandwidth", "nvbandwidth_h100_pass.txt")
    toolbox.install("all_reduce_perf", "nccl_all_reduce_h100_pass.txt")
    toolbox.install("ib_write_bw", "ib_write_bw_ndr400_pass.txt")
    toolbox.install("mpirun", "nccl_multi_node_pass.txt")


@pytest.mark.parametrize(("level", "parts"), [("medium", MEDIUM_PARTS), ("full", FULL_PARTS)])
def test_missing_tools_are_unknown_and_listed(toolbox: ToolBox, level: str, parts: list[str]) -> None:
    report = run(level, peers=["gpu-h100-002"])
    assert report["parts_ran"] == ["nvml", "xid_events", "xid_log"]
    assert report["parts_unknown"] == parts
    for part in parts:
        result = check(report, part)
        assert result["status"] == "unknown"
        assert "not installed" in result["message"]
    # every GPU itself is healthy; the node is unknown because parts could not be judged
    assert {gpu["verdict"] for gpu in report["gpus"]} == {"pass"}
    assert report["verdict"] == "unknown"
    assert report["recommended_action"] == "investigate"


def test_medium_with_healthy_tools_passes(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    report = run("medium")
    assert report["verdict"] == "pass", report["problems"]
    assert report["parts_ran"] == ["nvml", "xid_events", "xid_log", *MEDIUM_PARTS]
    assert report["parts_unknown"] == []
    assert check(report, "dcgm_diag")["value"]["tests"] == ["memory", "pcie", "software"]
    assert check(report, "nvbandwidth")["value"]["host_to_device_memcpy_ce"]["min"] > 48
    assert check(report, "nccl_all_reduce")["value"]["busbw_gbps"] == pytest.approx(477.86)
    assert toolbox.args("dcgmi") == ["diag", "-r", "2", "--json"]
    assert toolbox.args("all_reduce_perf") == ["-b", "16G", "-e", "16G", "-f", "2", "-g", "8"]
    assert toolbox.args("nvbandwidth")[:2] == ["-t", "host_to_device_memcpy_ce"]


def test_full_with_healthy_tools_and_peers_passes(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    report = run("full", peers=["gpu-h100-002"])
    assert report["verdict"] == "pass", report["problems"]
    assert report["parts_ran"][-5:] == FULL_PARTS
    assert check(report, "ib_write_bw")["value"] == {"gpu-h100-002": 392.31}
    assert check(report, "nccl_multi_node")["value"]["busbw_gbps"] >= 360
    assert toolbox.args("dcgmi") == ["diag", "-r", "3", "--json"]
    assert toolbox.args("ib_write_bw") == ["-s", "8388608", "-F", "--report_gbits", "gpu-h100-002"]
    assert toolbox.args("mpirun")[:4] == ["-np", "16", "-H", "gpu-h100-001:8,gpu-h100-002:8"]


def test_full_without_peers_leaves_the_network_unknown(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    report = run("full")
    assert report["parts_unknown"] == ["ib_write_bw", "nccl_multi_node"]
    assert "no peer nodes" in check(report, "ib_write_bw")["message"]
    assert report["verdict"] == "unknown"


def test_dcgm_failure_is_attached_to_its_gpu(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("dcgmi", "dcgmi_diag_r2_fail.json", rc=226)
    report = run("medium")
    diag = check(report, "dcgm_diag")
    assert diag["status"] == "fail"
    assert {(p["test"], p["gpu"], p["status"]) for p in diag["value"]["problems"]} == {
        ("memory", 3, "fail"),
        ("pcie", 5, "warn"),
    }
    gpu3 = report["gpus"][3]
    assert gpu3["verdict"] == "fail" and gpu3["action"] == "replace_gpu"
    assert "row remapping failed" in check(report, "dcgm_diag", 3)["message"]
    assert report["gpus"][5]["verdict"] == "warn"
    assert report["verdict"] == "fail" and report["recommended_action"] == "replace_gpu"


def test_dcgm_3_output_is_understood(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("dcgmi", "dcgmi_diag_v3_pass.json")
    report = run("medium")
    diag = check(report, "dcgm_diag")
    assert diag["status"] == "pass"
    assert diag["value"]["version"] == "3.3.5"
    assert "GPU Memory" in diag["value"]["tests"]


def test_dcgm_host_engine_down_is_unknown(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("dcgmi", "dcgmi_diag_runtime_error.json", rc=255)
    report = run("medium")
    assert check(report, "dcgm_diag")["status"] == "unknown"
    assert "host engine" in check(report, "dcgm_diag")["message"].lower()
    assert "dcgm_diag" in report["parts_ran"] and "dcgm_diag" in report["parts_unknown"]


def test_slow_bandwidth_fails(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("nvbandwidth", "nvbandwidth_h100_slow.txt")
    report = run("medium")
    result = check(report, "nvbandwidth")
    assert result["status"] == "fail"
    assert result["value"]["host_to_device_memcpy_ce"]["slow"] == [{"row": 0, "column": 3, "gbps": 27.61}]
    assert result["value"]["device_to_device_memcpy_read_ce"]["slow"] == [{"row": 3, "column": 5, "gbps": 120.37}]
    assert result["threshold"]["device_to_device_memcpy_read_ce"] == 335.0
    assert "host_to_device_memcpy_ce: 1 path below" in result["message"] and "(s)" not in result["message"]
    assert report["verdict"] == "fail"


def test_waived_peer_test_is_unknown_not_pass(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("nvbandwidth", "nvbandwidth_waived_p2p.json")
    result = check(run("medium"), "nvbandwidth")
    assert result["status"] == "unknown"
    assert "device_to_device_memcpy_read_ce waived" in result["message"]


def test_pcie_only_model_does_not_judge_peer_copies(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("nvbandwidth", "nvbandwidth_h100_slow.txt")  # P2P 120 GB/s, H2D min 27.6 GB/s
    report = run("medium", FakeNvml(model="L40S", seed=4))
    result = check(report, "nvbandwidth")
    assert set(result["threshold"]) == {"host_to_device_memcpy_ce", "device_to_host_memcpy_ce"}
    assert result["value"]["host_to_device_memcpy_ce"]["min"] == 27.61  # above L40S's 20 GB/s floor
    assert result["status"] == "pass"


@pytest.mark.parametrize(
    ("sample", "rc", "status", "needle"),
    [
        ("nccl_all_reduce_h100_low.txt", 0, "fail", "below 460"),
        ("nccl_all_reduce_h100_wrong.txt", 1, "fail", "Out of bounds values : 1024 FAILED"),
        (None, 1, "unknown", "no nccl-tests result rows"),
    ],
)
def test_nccl_is_judged(toolbox: ToolBox, sample: str | None, rc: int, status: str, needle: str) -> None:
    install_healthy(toolbox)
    toolbox.install("all_reduce_perf", sample, rc=rc, stderr="" if sample else "NCCL WARN Cuda failure 'out of memory'")
    result = check(run("medium"), "nccl_all_reduce")
    assert result["status"] == status
    assert needle in result["message"]


def test_low_ib_bandwidth_to_one_peer_fails(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.script(
        "ib_write_bw",
        "#!/bin/sh\n"
        'for last in "$@"; do :; done\n'
        f'if [ "$last" = "gpu-h100-003" ]; then exec {CAT} {DATA / "ib_write_bw_ndr400_low.txt"}; fi\n'
        f"exec {CAT} {DATA / 'ib_write_bw_ndr400_pass.txt'}\n",
    )
    report = run("full", peers=["gpu-h100-002", "gpu-h100-003"])
    result = check(report, "ib_write_bw")
    assert result["status"] == "fail"
    assert result["value"] == {"gpu-h100-002": 392.31, "gpu-h100-003": 212.37}
    assert "gpu-h100-003: 212.4 Gb/s below 380.0 Gb/s" in result["message"]


def test_a_hung_tool_times_out_as_unknown(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    toolbox.install("nvbandwidth", "nvbandwidth_h100_pass.txt", sleep_s=5)
    report = run("medium", tool_timeouts={"nvbandwidth": 0.5})
    result = check(report, "nvbandwidth")
    assert result["status"] == "unknown"
    assert "did not finish in" in result["message"]
    assert "nvbandwidth" in report["parts_unknown"]


def test_busy_gpus_skip_the_active_tests(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    report = run("medium", FakeNvml(seed=4, faults=[Fault("stray_process", gpu=2)]))
    for part in MEDIUM_PARTS:
        assert "processes on GPU 2" in check(report, part)["message"]
    assert report["parts_unknown"] == MEDIUM_PARTS
    assert not (toolbox.bindir / "dcgmi.args").exists()


def test_no_driver_skips_the_active_tests(toolbox: ToolBox) -> None:
    install_healthy(toolbox)
    report = run("medium", FakeNvml(faults=[Fault("init_failure", error="DriverNotLoaded")]))
    assert report["verdict"] == "fail"
    assert all("NVML unavailable" in check(report, part)["message"] for part in MEDIUM_PARTS)
    assert report["parts_unknown"] == ["nvml", "xid_events", *MEDIUM_PARTS]


@pytest.mark.parametrize("expect_idle", [True, False])
def test_gpus_read_free_of_processes_run_the_active_tests_whether_or_not_the_node_is_in_use(
        toolbox: ToolBox, expect_idle: bool) -> None:
    """On a node in use the process check only counts (it names no other team's pids): a count of 0 is as
    idle as an empty process list, and a count above 0 keeps the active tests off."""
    install_healthy(toolbox)
    report = run("medium", expect_idle=expect_idle)
    assert report["parts_unknown"] == [] and "dcgm_diag" in report["parts_ran"]
    busy = run("medium", FakeNvml(seed=4, faults=[Fault("stray_process", gpu=2)]), expect_idle=expect_idle)
    assert "processes on GPU 2" in check(busy, "dcgm_diag")["message"]
