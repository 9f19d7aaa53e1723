"""Active tests of the medium and full levels: run the tool if installed, parse, judge.

A missing binary, a timeout or output without results makes that part ``unknown`` with the
reason; only a measurement below its floor (or an explicit failure in the output) fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .parsers import (
    DcgmTestResult,
    parse_dcgmi_diag,
    parse_ib_write_bw,
    parse_nccl_tests,
    parse_nvbandwidth,
)
from .results import Action, CheckResult, Status, counted, recommended_action, worst_status
from .thresholds import GpuModelThresholds

DEFAULT_TIMEOUTS_S: dict[str, float] = {
    "dcgm_diag": 1800.0,  # -r 3 runs ~15 min (DG)
    "nvbandwidth": 600.0,
    "nccl_all_reduce": 600.0,
    "ib_write_bw": 120.0,  # per peer
    "nccl_multi_node": 900.0,
}

NVBANDWIDTH_TESTS: dict[str, str] = {
    "host_to_device_memcpy_ce": "h2d_min_gbps",
    "device_to_host_memcpy_ce": "d2h_min_gbps",
    "device_to_device_memcpy_read_ce": "p2p_min_gbps",
}

# NCCL needs large messages to reach bus peak; 256 MB is too small (NCCL).
NCCL_ARGS = ["-b", "16G", "-e", "16G", "-f", "2"]
IB_WRITE_BW_ARGS = ["-s", "8388608", "-F", "--report_gbits"]


@dataclass
class ToolRun:
    """What one tool invocation produced."""

    argv: list[str]
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    timed_out: bool = False
    missing: str | None = None  # the binary that is not installed

    def tail(self, chars: int = 300) -> str:
        """Return the end of stderr (or stdout) for messages."""
        text = (self.stderr or self.stdout).strip()
        return text[-chars:]


@dataclass
class PartResult:
    """A part of a level (one tool): its node check and any per-GPU findings."""

    part: str
    check: CheckResult
    ran: bool
    gpu_checks: dict[int, list[CheckResult]] = field(default_factory=dict)


def run_tool(argv: Sequence[str], timeout_s: float, requires: Sequence[str] = ()) -> ToolRun:
    """Run a tool found on PATH; report a missing binary or a timeout instead of raising."""
    run = ToolRun(list(argv))
    for binary in (argv[0], *requires):
        if shutil.which(binary) is None:
            run.missing = binary
            return run
    started = time.monotonic()
    try:
        # A session of its own, so a timeout kills the tool's children too (dcgmi runs nvvs).
        process = subprocess.Popen(  # noqa: S603 - argv built from constants and hostnames, no shell
            run.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except OSError as exc:
        run.stderr = str(exc)
        return run
    try:
        run.stdout, run.stderr = process.communicate(timeout=timeout_s)
        run.rc = process.returncode
    except subprocess.TimeoutExpired:
        run.timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        run.stdout, run.stderr = _decode(out), _decode(err)
    run.duration_s = round(time.monotonic() - started, 3)
    return run


# run_tool's signature: (argv, timeout_s, requires=()) -> ToolRun. The simulated fleet passes its own.
ToolRunner = Callable[..., ToolRun]


def _decode(data: Any) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)


def _not_run(part: str, run: ToolRun, timeout_s: float) -> PartResult | None:
    """Return the unknown result of a tool that is missing or timed out, else None."""
    if run.missing:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, None, None, f"{run.missing} not installed; not run", Action.INVESTIGATE),
            ran=False,
        )
    if run.timed_out:
        return PartResult(
            part,
            CheckResult(
                part,
                Status.UNKNOWN,
                None,
                None,
                f"{run.argv[0]} did not finish in {timeout_s:.0f} s",
                Action.INVESTIGATE,
            ),
            ran=True,
        )
    return None


def skipped(part: str, reason: str) -> PartResult:
    """Return the unknown result of a part that was deliberately not run."""
    return PartResult(part, CheckResult(part, Status.UNKNOWN, None, None, reason, Action.INVESTIGATE), ran=False)


# --- DCGM ----------------------------------------------------------------------------------------


def _dcgm_action(result: DcgmTestResult) -> Action:
    """Map a failed DCGM test to a repair: PCIe reseats, memory replaces, EUD (field diag) is an RMA."""
    test = result.test.lower().replace(" ", "_")
    if "pcie" in test:
        return Action.RESEAT
    if test in {"memory", "gpu_memory", "memtest"}:
        return Action.REPLACE_GPU
    if "eud" in test:
        return Action.RMA
    return Action.INVESTIGATE


def judge_dcgm_diag(run: ToolRun, timeout_s: float) -> PartResult:
    """Judge dcgmi diag: any Fail fails, any Warn warns (DD, GCMD); results are attached per GPU."""
    part = "dcgm_diag"
    not_run = _not_run(part, run, timeout_s)
    if not_run:
        return not_run
    try:
        diag = parse_dcgmi_diag(run.stdout)
    except ValueError as exc:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, {"rc": run.rc}, None, f"{exc}: {run.tail()}", Action.INVESTIGATE),
            ran=True,
        )
    if diag.runtime_error:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, None, None, f"dcgmi: {diag.runtime_error}", Action.INVESTIGATE),
            ran=True,
        )
    judged = [r for r in diag.results if r.status != "skip"]
    if not judged:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, None, None, "every DCGM test was skipped", Action.INVESTIGATE),
            ran=True,
        )
    gpu_checks: dict[int, list[CheckResult]] = {}
    node_results: list[CheckResult] = []
    problems: list[dict[str, Any]] = []
    for r in judged:
        status = {"pass": Status.PASS, "warn": Status.WARN, "fail": Status.FAIL}[r.status]
        action = _dcgm_action(r) if status is Status.FAIL else Action.MONITOR
        message = f"{r.test}: {r.status}" + (f" - {'; '.join(r.messages)}" if r.messages else "")
        check = CheckResult(part, status, {"test": r.test, "category": r.category}, "pass", message, action)
        node_results.append(check)
        if status is not Status.PASS:
            problems.append({"test": r.test, "gpu": r.gpu, "status": r.status, "messages": list(r.messages)})
            if r.gpu is not None:
                gpu_checks.setdefault(r.gpu, []).append(check)
    tests = sorted({r.test for r in judged})
    status = worst_status(node_results)
    message = (
        f"{len(tests)} DCGM tests passed"
        if status is Status.PASS
        else "; ".join(f"{p['test']} {p['status']} on GPU {p['gpu']}" for p in problems)
    )
    value = {"version": diag.version, "tests": tests, "problems": problems}
    check = CheckResult(part, status, value, "pass", message, recommended_action(node_results))
    return PartResult(part, check, True, gpu_checks)


# --- nvbandwidth ---------------------------------------------------------------------------------


def judge_nvbandwidth(run: ToolRun, thresholds: GpuModelThresholds, timeout_s: float) -> PartResult:
    """Judge host<->GPU and GPU<->GPU copy bandwidth against the model's floors (AZ)."""
    part = "nvbandwidth"
    not_run = _not_run(part, run, timeout_s)
    if not_run:
        return not_run
    try:
        tests = parse_nvbandwidth(run.stdout)
    except ValueError as exc:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, {"rc": run.rc}, None, f"{exc}: {run.tail()}", Action.INVESTIGATE),
            ran=True,
        )
    results: list[CheckResult] = []
    value: dict[str, Any] = {}
    threshold: dict[str, float] = {}
    for test, floor_field in NVBANDWIDTH_TESTS.items():
        floor = getattr(thresholds, floor_field)
        if floor is None:
            continue  # deliberately not judged for this model (e.g. PCIe peer copies on L40S)
        threshold[test] = floor
        matrix = tests.get(test)
        if matrix is None or not matrix.values():
            reason = f"{matrix.status}: {matrix.message}" if matrix else "not in output"
            results.append(CheckResult(part, Status.UNKNOWN, action=Action.INVESTIGATE, message=f"{test} {reason}"))
            value[test] = None
            continue
        slow = [
            {"row": r, "column": c, "gbps": v}
            for r, row in enumerate(matrix.rows)
            for c, v in enumerate(row)
            if v is not None and v < floor
        ]
        value[test] = {"min": min(matrix.values()), "slow": slow}
        if slow:
            results.append(
                CheckResult(
                    part,
                    Status.FAIL,
                    message=f"{test}: {counted(len(slow), 'path')} below {floor} GB/s (min {min(matrix.values()):.1f})",
                    action=Action.INVESTIGATE,
                )
            )
        else:
            results.append(CheckResult(part, Status.PASS, message=f"{test}: min {min(matrix.values()):.1f} GB/s"))
    if not results:
        results.append(
            CheckResult(part, Status.UNKNOWN, message="no bandwidth floor configured", action=Action.INVESTIGATE)
        )
    message = "; ".join(r.message for r in results)
    return PartResult(
        part, CheckResult(part, worst_status(results), value, threshold, message, recommended_action(results)), True
    )


# --- NCCL ----------------------------------------------------------------------------------------


def judge_nccl(part: str, run: ToolRun, floor: float | None, timeout_s: float) -> PartResult:
    """Judge an all_reduce_perf run: corrupted data or busbw below the floor fails (AZ, NCCL)."""
    not_run = _not_run(part, run, timeout_s)
    if not_run:
        return not_run
    try:
        nccl = parse_nccl_tests(run.stdout + "\n" + run.stderr)
    except ValueError as exc:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, {"rc": run.rc}, floor, f"{exc}: {run.tail()}", Action.INVESTIGATE),
            ran=True,
        )
    peak = nccl.peak_row
    busbw = min(peak.oop_busbw, peak.ip_busbw) if peak else None
    value = {"busbw_gbps": busbw, "avg_busbw_gbps": nccl.avg_busbw, "wrong": nccl.wrong, "rc": run.rc}
    if nccl.failures or nccl.wrong:
        detail = "; ".join(nccl.failures[:3]) or f"{counted(nccl.wrong, 'result row')} with #wrong > 0"
        return PartResult(
            part, CheckResult(part, Status.FAIL, value, floor, f"NCCL test failed: {detail}", Action.INVESTIGATE), True
        )
    if busbw is None or run.rc not in (0, None):
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, value, floor, f"no complete result (rc={run.rc}): {run.tail()}"),
            True,
        )
    if floor is None:
        return PartResult(
            part,
            CheckResult(part, Status.UNKNOWN, value, None, f"busbw {busbw:.1f} GB/s; no floor configured"),
            True,
        )
    if busbw < floor:
        return PartResult(
            part,
            CheckResult(
                part, Status.FAIL, value, floor, f"busbw {busbw:.1f} GB/s below {floor} GB/s", Action.INVESTIGATE
            ),
            True,
        )
    return PartResult(part, CheckResult(part, Status.PASS, value, floor, f"busbw {busbw:.1f} GB/s"), True)


def nccl_single_node(
    gpus: int, thresholds: GpuModelThresholds, timeout_s: float, runner: ToolRunner | None = None
) -> PartResult:
    """Run all_reduce_perf across this node's GPUs in one process and judge it."""
    run = (runner or run_tool)(["all_reduce_perf", *NCCL_ARGS, "-g", str(max(gpus, 1))], timeout_s)
    return judge_nccl("nccl_all_reduce", run, thresholds.nccl_busbw_min_gbps, timeout_s)


def nccl_multi_node(
    hostname: str,
    peers: Sequence[str],
    gpus_per_node: int,
    thresholds: GpuModelThresholds,
    timeout_s: float,
    runner: ToolRunner | None = None,
) -> PartResult:
    """Run all_reduce_perf over this node and its peers with mpirun, one rank per GPU."""
    hosts = [hostname, *peers]
    argv = [
        "mpirun",
        "-np",
        str(len(hosts) * gpus_per_node),
        "-H",
        ",".join(f"{host}:{gpus_per_node}" for host in hosts),
        "all_reduce_perf",
        *NCCL_ARGS,
        "-g",
        "1",
    ]
    run = (runner or run_tool)(argv, timeout_s, requires=("all_reduce_perf",))
    return judge_nccl("nccl_multi_node", run, thresholds.nccl_multinode_busbw_min_gbps, timeout_s)


# --- InfiniBand ----------------------------------------------------------------------------------


def ib_write_bw_pairs(
    peers: Sequence[str],
    thresholds: GpuModelThresholds,
    timeout_s: float,
    device: str | None = None,
    runner: ToolRunner | None = None,
) -> PartResult:
    """Measure RDMA write bandwidth to each peer (its ib_write_bw server must be listening) (AZ)."""
    part = "ib_write_bw"
    floor = thresholds.ib_write_bw_min_gbps
    results: list[CheckResult] = []
    value: dict[str, Any] = {}
    ran = False
    for peer in peers:
        argv = ["ib_write_bw", *IB_WRITE_BW_ARGS, *(["-d", device] if device else []), peer]
        run = (runner or run_tool)(argv, timeout_s)
        not_run = _not_run(part, run, timeout_s)
        if not_run:
            if run.missing:
                return not_run  # the same for every peer
            ran = True
            results.append(not_run.check)
            value[peer] = None
            continue
        ran = True
        try:
            measured = parse_ib_write_bw(run.stdout)
        except ValueError:
            value[peer] = None
            results.append(
                CheckResult(part, Status.UNKNOWN, message=f"{peer}: no result (rc={run.rc}) {run.tail(120)}")
            )
            continue
        value[peer] = round(measured.average_gbps, 2)
        if floor is None:
            results.append(CheckResult(part, Status.UNKNOWN, message=f"{peer}: no floor configured"))
        elif measured.average_gbps < floor:
            results.append(
                CheckResult(
                    part,
                    Status.FAIL,
                    message=f"{peer}: {measured.average_gbps:.1f} Gb/s below {floor} Gb/s",
                    action=Action.INVESTIGATE,
                )
            )
        else:
            results.append(CheckResult(part, Status.PASS, message=f"{peer}: {measured.average_gbps:.1f} Gb/s"))
    message = "; ".join(r.message for r in results)
    return PartResult(
        part,
        CheckResult(part, worst_status(results), value, floor, message, recommended_action(results)),
        ran,
    )


# --- DCGM + nvbandwidth runners ------------------------------------------------------------------


def dcgm_diag(level: int, timeout_s: float, runner: ToolRunner | None = None) -> PartResult:
    """Run `dcgmi diag -r LEVEL --json` and judge it."""
    return judge_dcgm_diag((runner or run_tool)(["dcgmi", "diag", "-r", str(level), "--json"], timeout_s), timeout_s)


def nvbandwidth(thresholds: GpuModelThresholds, timeout_s: float, runner: ToolRunner | None = None) -> PartResult:
    """Run nvbandwidth's copy-engine tests and judge them."""
    run = (runner or run_tool)(["nvbandwidth", "-t", *NVBANDWIDTH_TESTS], timeout_s)
    return judge_nvbandwidth(run, thresholds, timeout_s)
