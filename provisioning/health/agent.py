"""The node health agent: run one check level and return (or print) the report.

    python -m provisioning.health.agent --level quick --json [--fake '<spec>']

Exit codes: 0 pass, 1 warn, 2 fail, 3 unknown (64 for a usage error). This module and everything
it imports are plain Python: the agent runs on GPU nodes that have no portal settings or Django.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import tools
from .checks import (
    NVML_ERRORS,
    GpuContext,
    GpuIdentity,
    LiveXid,
    Nvml,
    XidEventWatcher,
    check_cuda_support,
    check_gpu_count,
    check_gpu_model,
    check_vbios_consistency,
    check_version_pin,
    describe_error,
    format_cuda_version,
    gpu_checks_for,
    is_gpu_lost,
    nvml_error_result,
    process_count,
    read_identity,
    unmapped_xid_check,
    xid_check,
)
from .fake_nvml import ENV_VAR, fake_for_host
from .results import (
    EXIT_CODES,
    Action,
    CheckResult,
    GpuResult,
    Status,
    counted,
    gpus_named,
    recommended_action,
    worst_status,
)
from .thresholds import GENERIC, GpuModelThresholds, thresholds_for, thresholds_from_config
from .xid import HealthState, KernelLogUnavailable, KernelXid, parse_kernel_log, read_system_kernel_log

LEVELS = ("quick", "medium", "full")
SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")

# Parts a report can list in parts_ran / parts_unknown.
PARTS = (
    "nvml",
    "xid_events",
    "xid_log",
    "dcgm_diag",
    "nvbandwidth",
    "nccl_all_reduce",
    "ib_write_bw",
    "nccl_multi_node",
)

_INIT_FAILURES: dict[str, tuple[Status, Action, str]] = {
    "NVMLError_LibraryNotFound": (Status.FAIL, Action.INVESTIGATE, "NVIDIA driver library not found"),
    "NVMLError_DriverNotLoaded": (Status.FAIL, Action.REBOOT, "NVIDIA kernel driver not loaded"),
    "NVMLError_LibRmVersionMismatch": (
        Status.FAIL,
        Action.REBOOT,
        "user-space driver and kernel module versions differ (reboot after a driver change)",
    ),
    "NVMLError_NoPermission": (Status.UNKNOWN, Action.INVESTIGATE, "the agent may not use NVML"),
}


def utc_now() -> str:
    """Return the current time as ISO 8601 UTC with a Z."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _GpuWorker:
    """Run every check of one GPU in its own thread, so one hung NVML call cannot stall the node."""

    def __init__(
        self,
        nvml: Nvml,
        index: int,
        pick_thresholds: Callable[[str], GpuModelThresholds],
        state: HealthState,
        watcher: XidEventWatcher,
        now: float,
        expect_idle: bool,
    ) -> None:
        self.nvml = nvml
        self.index = index
        self.pick_thresholds = pick_thresholds
        self.state = state
        self.watcher = watcher
        self.checks: list[CheckResult] = []
        self.identity: GpuIdentity | None = None
        self.ctx = GpuContext(index=index, thresholds=GENERIC, now=now, expect_idle=expect_idle)
        self.thread = threading.Thread(target=self._run, name=f"gpu-checks-{index}", daemon=True)
        self.done = False

    def _run(self) -> None:
        nvml, ctx = self.nvml, self.ctx
        try:
            handle = ctx.call(nvml, "nvmlDeviceGetHandleByIndex", self.index)
            self.identity = read_identity(nvml, handle, ctx)
        except NVML_ERRORS as exc:
            self.checks.append(nvml_error_result("gpu_accessible", exc, ctx.current_call))
            self.done = True
            return
        identity = self.identity
        self.checks.append(CheckResult("gpu_accessible", Status.PASS, identity.name, None, "GPU answers NVML"))
        ctx.thresholds = self.pick_thresholds(identity.name)
        ctx.uuid = identity.uuid
        ctx.baseline = self.state.baseline(identity.uuid)
        self.watcher.register(self.index, handle, identity.uuid)
        for check in gpu_checks_for(ctx.thresholds):
            try:
                result = check(nvml, handle, ctx)
            except Exception as exc:  # a bug must not cost the whole report; it shows as unknown
                name = getattr(check, "check_name", check.__name__)
                result = CheckResult(name, Status.UNKNOWN, None, None, f"internal error: {exc!r}", Action.INVESTIGATE)
            self.checks.append(result)
            if is_gpu_lost(result):
                break  # every later call would only repeat that the GPU is gone
        self.done = True

    def result(self, timeout_s: float) -> GpuResult:
        """Return what the worker found; an unfinished worker adds why it is incomplete."""
        checks = list(self.checks)  # snapshot: a hung worker may still append later
        if not self.done:
            checks.append(
                CheckResult(
                    "responsive",
                    Status.UNKNOWN,
                    self.ctx.current_call,
                    timeout_s,
                    f"NVML call {self.ctx.current_call} did not return within {timeout_s:g} s",
                    Action.INVESTIGATE,
                )
            )
        identity = self.identity
        return GpuResult(
            index=self.index,
            uuid=identity.uuid if identity else None,
            serial=identity.serial if identity else None,
            name=identity.name if identity else None,
            pci_bus_id=(
                f"{identity.pci[0]:08x}:{identity.pci[1]:02x}:{identity.pci[2]:02x}.0"
                if identity and identity.pci
                else None
            ),
            checks=checks,
        )


def _kernel_log_lines(
    nvml: Nvml, kernel_log: Callable[[], Sequence[str]] | None
) -> tuple[list[str] | None, str | None]:
    """Return (lines, None) or (None, reason) from the given source, the fake's log, or dmesg/journal."""
    source = kernel_log or getattr(nvml, "read_kernel_log", None) or read_system_kernel_log
    try:
        return list(source()), None
    except (KernelLogUnavailable, OSError) as exc:
        return None, str(exc)


def run_checks(
    level: str = "quick",
    nvml: Nvml | None = None,
    peers: Sequence[str] = (),
    *,
    hostname: str | None = None,
    model: str | None = None,
    expected_gpus: int | None = None,
    thresholds: GpuModelThresholds | None = None,
    threshold_table: Mapping[str, GpuModelThresholds] | None = None,
    driver_pin: str | None = None,
    cuda_pin: str | None = None,
    cuda_min: str | None = None,
    state: HealthState | None = None,
    state_path: str | os.PathLike[str] | None = None,
    kernel_log: Callable[[], Sequence[str]] | None = None,
    expect_idle: bool = True,
    event_wait_ms: int = 500,
    nvml_timeout_s: float = 20.0,
    tool_timeouts: Mapping[str, float] | None = None,
    ib_device: str | None = None,
    tool_runner: tools.ToolRunner | None = None,
    xid_receipt: str | None = None,
) -> dict[str, Any]:
    """Run one level of health checks on this node and return the report (see report.schema.json).

    - ``nvml``: the pynvml module (default) or a FakeNvml.
    - ``peers``: the other nodes of the reservation, for the full level's network tests.
    - ``model`` / ``thresholds``: the pool's GPU model; by default detected from NVML's names.
    - ``driver_pin`` / ``cuda_pin``: fleet pins; a node off them warns.
    - ``cuda_min``: the CUDA version the node's cluster chose ("12.4"); the node fails when its driver
      supports only older ones (check ``cuda_support``). None (an idle node): no such check.
    - ``state`` / ``state_path``: XIDs already reported and counter baselines; the file is
      read before and written after the run. Without either, nothing is remembered.
    - ``xid_receipt``: the report is sent on (the node agent: the check's id); the kernel-log XIDs it
      carries and its counter readings are held under it: the XIDs count as reported, and the readings
      as the next baseline, only once the portal stored it (``HealthState.accept``). Without it (the CLI
      prints its report) both count once the run ends.
    - ``kernel_log``: a callable returning kernel-log lines (default: the fake's log, else dmesg).
    - ``expect_idle``: processes on a GPU fail the check (before hand-over); pass False while a
      tenant's jobs run.
    - ``tool_runner``: runs the medium/full tools (default: ``tools.run_tool``, the binaries on
      PATH); the simulated fleet passes canned outputs.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    started_at, t0, now = utc_now(), time.monotonic(), time.time()
    if nvml is None:
        import pynvml as nvml  # imported late: only a real run needs the real library
    hostname = hostname or getattr(nvml, "hostname", None) or socket.gethostname()
    if state is None:
        state = HealthState.load(state_path) if state_path else HealthState()
    timeouts = {**tools.DEFAULT_TIMEOUTS_S, **(tool_timeouts or {})}
    requested = thresholds or (thresholds_for(model, threshold_table) if model else None)

    def pick_thresholds(device_name: str) -> GpuModelThresholds:
        return requested or thresholds_for(device_name, threshold_table) or GENERIC

    node_checks: list[CheckResult] = []
    gpus: list[GpuResult] = []
    parts_ran: list[str] = []
    parts_unknown: list[str] = []
    driver = cuda = None
    gpu_count: int | None = None
    nvml_ok = False
    live: list[LiveXid] = []
    watcher = XidEventWatcher(nvml)
    workers: list[_GpuWorker] = []

    try:
        nvml.nvmlInit()
        nvml_ok = True
    except NVML_ERRORS as exc:
        status, action, meaning = _INIT_FAILURES.get(
            type(exc).__name__, (Status.UNKNOWN, Action.INVESTIGATE, "NVML could not start")
        )
        node_checks.append(
            CheckResult("nvml_init", status, None, "initialised", f"{meaning}: {describe_error(exc)}", action)
        )
        parts_unknown += ["nvml", "xid_events"]

    if nvml_ok:
        parts_ran.append("nvml")
        node_checks.append(CheckResult("nvml_init", Status.PASS, "initialised", "initialised", "NVML initialised"))
        driver_error = cuda_error = count_error = None
        try:
            raw = nvml.nvmlSystemGetDriverVersion()
            driver = raw.decode() if isinstance(raw, bytes) else str(raw)
        except NVML_ERRORS as exc:
            driver_error = describe_error(exc)
        try:
            cuda = format_cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
        except NVML_ERRORS as exc:
            cuda_error = describe_error(exc)
        try:
            gpu_count = int(nvml.nvmlDeviceGetCount())
        except NVML_ERRORS as exc:
            count_error = describe_error(exc)
        try:
            # Created up front so events raised while the other checks run are caught (KDP).
            watcher.event_set = nvml.nvmlEventSetCreate()
        except NVML_ERRORS as exc:
            watcher.create_error = describe_error(exc)
        workers = [
            _GpuWorker(nvml, i, pick_thresholds, state, watcher, now, expect_idle) for i in range(gpu_count or 0)
        ]
        for worker in workers:
            worker.thread.start()
        deadline = time.monotonic() + nvml_timeout_s
        for worker in workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        gpus = [worker.result(nvml_timeout_s) for worker in workers]
        live = watcher.drain(event_wait_ms)
        watcher.close()

        names = [w.identity.name for w in workers if w.identity]
        profile = requested or (pick_thresholds(names[0]) if names else GENERIC)
        node_checks.append(check_version_pin("driver_version", driver, driver_pin or profile.driver_pin, driver_error))
        node_checks.append(check_version_pin("cuda_version", cuda, cuda_pin or profile.cuda_pin, cuda_error))
        if cuda_min:
            node_checks.append(check_cuda_support(cuda, cuda_min, cuda_error))
        if model and requested is None:
            # A pool model we have no profile for must not silently fall back to detection.
            node_checks.append(
                CheckResult(
                    "gpu_model",
                    Status.UNKNOWN,
                    {"names": sorted(set(names)), "profile": None},
                    model,
                    f"no thresholds configured for the pool's model {model!r}",
                    Action.INVESTIGATE,
                )
            )
        else:
            node_checks.append(check_gpu_model(names, model or (requested.model if requested else None), profile))
        node_checks.append(check_gpu_count(gpu_count, expected_gpus or profile.gpus_per_node, count_error))
        if names:
            identities = [w.identity for w in workers if w.identity]
            node_checks.append(
                check_vbios_consistency(
                    {w.index: w.identity.vbios for w in workers if w.identity},
                    [i.errors["vbios"] for i in identities if "vbios" in i.errors],
                )
            )
        event_problem = watcher.create_error or watcher.wait_error
        if event_problem:
            parts_unknown.append("xid_events")
            node_checks.append(CheckResult("xid_events", Status.UNKNOWN, None, None, event_problem, Action.INVESTIGATE))
        else:
            parts_ran.append("xid_events")
            orphans = [e for e in live if e.gpu_index is None]
            if orphans:
                # An event whose GPU could not be named (e.g. it fell off the bus) is still a finding.
                judged = xid_check(orphans, [])
                node_checks.append(
                    CheckResult(
                        "xid_events",
                        judged.status,
                        {"registered_gpus": sorted(watcher.registered), "events": len(live), "unmapped": judged.value},
                        judged.threshold,
                        "XID events from a GPU NVML could not name: " + judged.message,
                        judged.action,
                    )
                )
            else:
                node_checks.append(
                    CheckResult(
                        "xid_events",
                        Status.PASS,
                        {"registered_gpus": sorted(watcher.registered), "events": len(live)},
                        None,
                        f"listened for XID events on {counted(len(watcher.registered), 'GPU')}",
                    )
                )
    else:
        profile = requested or GENERIC

    # Kernel-log XIDs: only lines not reported before, mapped to GPUs by PCI address.
    lines, log_error = _kernel_log_lines(nvml, kernel_log)
    new_xids: list[KernelXid] = []
    if lines is not None:
        parts_ran.append("xid_log")
        new_xids = [x for x in parse_kernel_log(lines) if not state.is_reported(x.key)]
    else:
        parts_unknown.append("xid_log")
    by_pci = {w.identity.pci: w.index for w in workers if w.identity and w.identity.pci}
    unmapped = [x for x in new_xids if x.pci not in by_pci]
    for gpu, worker in zip(gpus, workers, strict=True):
        if worker.identity is None:
            continue
        unavailable = []
        if gpu.index not in watcher.registered:
            reason = watcher.errors.get(gpu.index) or watcher.create_error or "not registered"
            unavailable.append(f"live events ({reason})")
        elif watcher.wait_error:
            unavailable.append(f"live events ({watcher.wait_error})")
        if log_error is not None:
            unavailable.append(f"kernel log ({log_error})")
        gpu.checks.append(
            xid_check(
                [e for e in live if e.gpu_index == gpu.index],
                [x for x in new_xids if by_pci.get(x.pci) == gpu.index],
                unavailable,
            )
        )
    node_checks.append(unmapped_xid_check(unmapped, log_error))

    # Medium and full levels: active tests, only on a node whose NVML works and whose GPUs are idle.
    if level != "quick":
        for part in _active_parts(
            level, nvml_ok, gpus, hostname, peers, profile, gpu_count, timeouts, ib_device, tool_runner
        ):
            node_checks.append(part.check)
            for index, extra in part.gpu_checks.items():
                if 0 <= index < len(gpus):
                    gpus[index].checks.extend(extra)
            if part.ran:
                parts_ran.append(part.part)
            if not part.ran or part.check.status is Status.UNKNOWN:
                parts_unknown.append(part.part)

    if nvml_ok and all(worker.done for worker in workers):
        try:
            nvml.nvmlShutdown()
        except NVML_ERRORS:
            pass  # the report is complete; a failing shutdown changes nothing in it
    readings = {worker.identity.uuid: worker.ctx.readings
                for worker in workers if worker.done and worker.identity and worker.identity.uuid}
    if xid_receipt is not None:
        # Held until the portal stored the report: only then are its XIDs reported and its readings the baseline.
        state.hold(xid_receipt, [xid.key for xid in new_xids], counters=readings)
    else:
        for uuid, values in readings.items():
            state.record(uuid, values)
        for xid in new_xids:
            state.mark_reported(xid.key)
    if state_path:
        state.save(state_path)

    all_checks = node_checks + [check for gpu in gpus for check in gpu.checks]
    verdict = worst_status(all_checks)
    problems = [
        {"gpu": None, "check": c.name, "status": str(c.status), "action": str(c.action), "message": c.message}
        for c in node_checks
        if c.status is not Status.PASS
    ] + [
        {"gpu": g.index, "check": c.name, "status": str(c.status), "action": str(c.action), "message": c.message}
        for g in gpus
        for c in g.checks
        if c.status is not Status.PASS
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "hostname": hostname,
        "level": level,
        "started_at": started_at,
        "finished_at": utc_now(),
        "duration_s": round(time.monotonic() - t0, 3),
        "driver_version": driver,
        "cuda_version": cuda,
        "gpu_model": profile.model,
        "gpu_count": gpu_count,
        "expected_gpus": expected_gpus or profile.gpus_per_node,
        "gpus": [gpu.to_dict() for gpu in gpus],
        "node_checks": [check.to_dict() for check in node_checks],
        "parts_ran": parts_ran,
        "parts_unknown": parts_unknown,
        "verdict": str(verdict),
        "recommended_action": str(recommended_action(all_checks)),
        "problems": problems,
    }


def _active_parts(
    level: str,
    nvml_ok: bool,
    gpus: Sequence[GpuResult],
    hostname: str,
    peers: Sequence[str],
    profile: GpuModelThresholds,
    gpu_count: int | None,
    timeouts: Mapping[str, float],
    ib_device: str | None,
    runner: tools.ToolRunner | None = None,
) -> list[tools.PartResult]:
    """Run (or explain why not) the medium/full parts, in order."""
    parts = ["dcgm_diag", "nvbandwidth", "nccl_all_reduce"]
    if level == "full":
        parts += ["ib_write_bw", "nccl_multi_node"]
    if not nvml_ok:
        return [tools.skipped(p, "not run: NVML unavailable") for p in parts]
    # Any process counts, expected or not: a tenant's job on a GPU must never share it with DCGM.
    busy = [
        g.index
        for g in gpus
        for c in g.checks
        if c.name == "compute_processes" and (c.status is Status.FAIL or process_count(c) > 0)
    ]
    if busy:
        # Active tests consume the GPUs (DD) and would disturb, and be disturbed by, those processes.
        return [tools.skipped(p, f"not run: processes on {gpus_named(busy)}") for p in parts]
    # Only a process list read empty proves a GPU idle; unreadable (NoPermission under MIG, an old
    # driver) or never reached (hung or lost GPU) is not "no processes".
    unproven = [
        g.index
        for g in gpus
        if not any(c.name == "compute_processes" and c.status is Status.PASS and process_count(c) == 0
                   for c in g.checks)
    ]
    if unproven:
        verb = "is" if len(unproven) == 1 else "are"
        return [tools.skipped(p, f"not run: {gpus_named(unproven)} {verb} not known to be idle") for p in parts]
    results = [
        tools.dcgm_diag(3 if level == "full" else 2, timeouts["dcgm_diag"], runner),
        tools.nvbandwidth(profile, timeouts["nvbandwidth"], runner),
        tools.nccl_single_node(gpu_count or 0, profile, timeouts["nccl_all_reduce"], runner),
    ]
    if level == "full":
        if peers:
            results.append(tools.ib_write_bw_pairs(peers, profile, timeouts["ib_write_bw"], ib_device, runner))
            results.append(
                tools.nccl_multi_node(
                    hostname,
                    peers,
                    gpu_count or profile.gpus_per_node or 1,
                    profile,
                    timeouts["nccl_multi_node"],
                    runner,
                )
            )
        else:
            results += [tools.skipped(p, "not run: no peer nodes given") for p in ("ib_write_bw", "nccl_multi_node")]
    return results


def exit_code(report: Mapping[str, Any]) -> int:
    """Return the CLI exit code for a report's verdict."""
    return EXIT_CODES[Status(report["verdict"])]


def _error_report(level: str, hostname: str, exc: BaseException) -> dict[str, Any]:
    """Return a valid report for an agent that crashed, so callers always get JSON."""
    now = utc_now()
    check = CheckResult("agent", Status.UNKNOWN, None, None, f"agent error: {exc!r}", Action.INVESTIGATE)
    return {
        "schema_version": SCHEMA_VERSION,
        "hostname": hostname,
        "level": level,
        "started_at": now,
        "finished_at": now,
        "duration_s": 0.0,
        "driver_version": None,
        "cuda_version": None,
        "gpu_model": None,
        "gpu_count": None,
        "expected_gpus": None,
        "gpus": [],
        "node_checks": [check.to_dict()],
        "parts_ran": [],
        "parts_unknown": ["nvml"],
        "verdict": "unknown",
        "recommended_action": "investigate",
        "problems": [
            {"gpu": None, "check": "agent", "status": "unknown", "action": "investigate", "message": check.message}
        ],
    }


def _format_text(report: Mapping[str, Any]) -> str:
    lines = [
        f"{report['hostname']} {report['level']}: {report['verdict'].upper()} "
        f"(action: {report['recommended_action']}, {report['duration_s']} s)"
    ]
    for problem in report["problems"]:
        where = "node" if problem["gpu"] is None else f"gpu{problem['gpu']}"
        lines.append(f"  {where} {problem['check']}: {problem['status']} - {problem['message']}")
    if report["parts_unknown"]:
        lines.append("  not judged: " + ", ".join(report["parts_unknown"]))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse exits 2 on usage errors, which would read as a "fail" verdict.
        self.print_usage(sys.stderr)
        self.exit(64, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the CLI's argument parser."""
    parser = _Parser(prog="python -m provisioning.health.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--level", choices=LEVELS, default="quick")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--fake", metavar="SPEC", help=f"fake NVML node or fleet spec as JSON (or env {ENV_VAR})")
    parser.add_argument("--hostname", help="report this hostname (and pick it from a fake fleet spec)")
    parser.add_argument("--peers", action="append", default=[], help="peer nodes for full level (comma list)")
    parser.add_argument("--model", help='the pool\'s GPU model, e.g. "H100-SXM" (default: detect)')
    parser.add_argument("--expected-gpus", type=int)
    parser.add_argument("--driver-pin")
    parser.add_argument("--cuda-pin")
    parser.add_argument("--cuda-min", help="the CUDA version the node's cluster needs; fail below it")
    parser.add_argument("--state", metavar="PATH", help="state file: XIDs already reported, counter baselines")
    parser.add_argument("--kernel-log", metavar="FILE", help="read kernel log lines from FILE instead of dmesg")
    parser.add_argument("--thresholds", metavar="FILE", help="JSON per-model threshold overrides")
    parser.add_argument("--no-expect-idle", action="store_true", help="GPUs may run tenant processes")
    parser.add_argument("--event-wait-ms", type=int, default=500)
    parser.add_argument("--nvml-timeout", type=float, default=20.0)
    parser.add_argument("--ib-device", help="HCA for ib_write_bw, e.g. mlx5_0")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    args = build_parser().parse_args(argv)
    hostname = args.hostname or socket.gethostname()
    try:
        nvml: Nvml = None
        spec = args.fake or os.environ.get(ENV_VAR)
        if spec:
            nvml = fake_for_host(hostname, spec)
        table = thresholds_from_config(json.loads(Path(args.thresholds).read_text())) if args.thresholds else None
        kernel_log = None
        if args.kernel_log:
            log_path = Path(args.kernel_log)

            def kernel_log() -> list[str]:
                return log_path.read_text(errors="replace").splitlines()

        report = run_checks(
            args.level,
            nvml,
            [peer for group in args.peers for peer in group.split(",") if peer],
            hostname=args.hostname or None,
            model=args.model,
            expected_gpus=args.expected_gpus,
            threshold_table=table,
            driver_pin=args.driver_pin,
            cuda_pin=args.cuda_pin,
            cuda_min=args.cuda_min,
            state_path=args.state,
            kernel_log=kernel_log,
            expect_idle=not args.no_expect_idle,
            event_wait_ms=args.event_wait_ms,
            nvml_timeout_s=args.nvml_timeout,
            ib_device=args.ib_device,
        )
    except Exception as exc:  # the caller parses our stdout; it must always be a report
        report = _error_report(args.level, hostname, exc)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format_text(report))
    sys.stdout.flush()
    code = exit_code(report)
    # Hung NVML calls leave daemon threads behind; do not wait for them at interpreter exit.
    if any(t.daemon and t.is_alive() for t in threading.enumerate() if t.name.startswith("gpu-checks-")):
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
