"""The agent side of a queued check: run one job's checks and shape the report for posting back.

A *job* is the JSON message the portal sends to an agent (``services.jobs_for``)::

    {"id": 17, "host": "h100-sxm-007", "level": "quick", "model": "H100-SXM", "gpus": 8,
     "idle": false, "peers": [], "pins": {"driver": "550.90.07"}, "cuda_min": "12.4", "detail": "compact",
     "heal": null}

``cuda_min`` is the CUDA version the node's cluster chose (only jobs of a cluster's nodes carry it;
absent or null: none is required): the node fails when its driver supports only older ones.

Real nodes run it with pynvml in the Celery worker of their own queue ``node.<hostname>``; the
simulated fleet runs many jobs per message on the ``fleet`` queue with a :class:`SimulatedFleet`
(FakeNvml per host, faults from ``PORTAL_FAKE_NVML``, canned tool outputs). Plain Python: no
Django here, so the node agent needs no database.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import tools
from .agent import _error_report, run_checks
from .fake_nvml import FakeNvml, fake_for_host
from .thresholds import GpuModelThresholds

__all__ = ["compact_report", "run_job", "SimulatedFleet", "SimulatedTools", "split_report"]

SIMULATED_DATA = Path(__file__).with_name("simulated")


def compact_report(report: Mapping[str, Any], *, keep_passing: bool = False) -> dict[str, Any]:
    """Return the report with passing checks reduced to their names, unless keep_passing.

    A passing quick check of 8 GPUs is ~30 kB in full and ~3 kB compact; scheduled checks of a
    10,000-node fleet every few minutes would otherwise fill the database with readings nobody
    looks at. Every non-passing check is kept whole.
    """
    if keep_passing:
        return dict(report)

    def squeeze(checks: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], list[str]]:
        kept = [c for c in checks if c["status"] != "pass"]
        passed = [c["name"] for c in checks if c["status"] == "pass"]
        return kept, passed

    out = dict(report)
    node_checks, node_passed = squeeze(report.get("node_checks") or [])
    out["node_checks"], out["node_passed"] = node_checks, node_passed
    gpus = []
    for gpu in report.get("gpus") or []:
        checks, passed = squeeze(gpu.get("checks") or [])
        gpus.append({**gpu, "checks": checks, "passed": passed})
    out["gpus"] = gpus
    return out


def split_report(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return (per-GPU results, the rest of the report) as the database stores them."""
    rest = {key: value for key, value in report.items() if key != "gpus"}
    return list(report.get("gpus") or []), rest


def run_job(
    job: Mapping[str, Any],
    *,
    nvml: Any = None,
    tool_runner: tools.ToolRunner | None = None,
    threshold_table: Mapping[str, GpuModelThresholds] | None = None,
    state_path: str | os.PathLike[str] | None = None,
    event_wait_ms: int = 500,
    nvml_timeout_s: float = 20.0,
    xid_receipt: str | None = None,
) -> dict[str, Any]:
    """Run the job's level on this node (nvml: pynvml by default) and return the report to post back.

    Never raises for a node problem: an agent error becomes an ``unknown`` report, so the portal
    always hears back. ``xid_receipt``: see :func:`agent.run_checks` (the kernel-log XIDs and counter
    readings sent wait for the portal's word that it stored the report).
    """
    level, host = job["level"], job["host"]
    pins = job.get("pins") or {}
    try:
        report = run_checks(
            level,
            nvml,
            list(job.get("peers") or ()),
            hostname=host,
            model=job.get("model") or None,
            expected_gpus=job.get("gpus") or None,
            threshold_table=threshold_table,
            driver_pin=pins.get("driver"),
            cuda_pin=pins.get("cuda"),
            cuda_min=job.get("cuda_min") or None,
            state_path=state_path,
            expect_idle=bool(job.get("idle", True)),
            event_wait_ms=event_wait_ms,
            nvml_timeout_s=nvml_timeout_s,
            tool_runner=tool_runner,
            xid_receipt=xid_receipt,
        )
    except Exception as exc:  # noqa: BLE001 - the portal must get a report whatever broke here
        report = _error_report(level, host, exc)
    # A failing report keeps every reading: whoever repairs the node wants the whole picture.
    return compact_report(report, keep_passing=job.get("detail") == "full" or report["verdict"] == "fail")


# --- the simulated fleet ---------------------------------------------------------------------------

# Canned outputs per tool and simulated outcome (captured-looking samples, see tests/health/data).
TOOL_OUTPUTS: dict[str, dict[str, tuple[str, int]]] = {
    "dcgmi": {"pass": ("dcgmi_diag_r2_pass.json", 0), "fail": ("dcgmi_diag_r2_fail.json", 226)},
    "nvbandwidth": {"pass": ("nvbandwidth_h100_pass.txt", 0), "slow": ("nvbandwidth_h100_slow.txt", 0)},
    "all_reduce_perf": {
        "pass": ("nccl_all_reduce_h100_pass.txt", 0),
        "low": ("nccl_all_reduce_h100_low.txt", 0),
        "wrong": ("nccl_all_reduce_h100_wrong.txt", 1),
    },
    "mpirun": {"pass": ("nccl_multi_node_pass.txt", 0)},
    "ib_write_bw": {"pass": ("ib_write_bw_ndr400_pass.txt", 0), "low": ("ib_write_bw_ndr400_low.txt", 0)},
}
_TOOL_TEXT: dict[str, str] = {}


class SimulatedTools:
    """A tool runner for simulated nodes: canned outputs; ``{"dcgmi": "fail"}`` picks a bad one.

    Outcomes: any key of TOOL_OUTPUTS[tool], or ``missing`` (not installed) or ``timeout``.
    """

    def __init__(self, outcomes: Mapping[str, str] | None = None) -> None:
        self.outcomes = dict(outcomes or {})
        for tool, outcome in self.outcomes.items():
            if tool not in TOOL_OUTPUTS or outcome not in (*TOOL_OUTPUTS[tool], "missing", "timeout"):
                raise ValueError(f"unknown simulated tool outcome {tool}={outcome!r}")

    def __call__(self, argv: Sequence[str], timeout_s: float, requires: Sequence[str] = ()) -> tools.ToolRun:
        tool = argv[0]
        run = tools.ToolRun(list(argv))
        outcome = self.outcomes.get(tool, "pass")
        if tool not in TOOL_OUTPUTS or outcome == "missing":
            run.missing = tool
            return run
        if outcome == "timeout":
            run.timed_out = True
            run.duration_s = timeout_s
            return run
        name, rc = TOOL_OUTPUTS[tool][outcome]
        if name not in _TOOL_TEXT:
            _TOOL_TEXT[name] = (SIMULATED_DATA / name).read_text()
        run.stdout, run.rc, run.duration_s = _TOOL_TEXT[name], rc, 0.0
        return run


class SimulatedFleet:
    """The fake hardware of a simulated fleet, described by PORTAL_FAKE_NVML.

    The spec is fake_for_host's fleet spec ({"default": {…}, "nodes": {host: {…} | [faults]}}),
    where a node may also name simulated tool outcomes: ``{"faults": [...], "tools":
    {"dcgmi": "fail"}}``. ``source`` is the JSON text, ``@/path/file.json`` (re-read whenever
    the file changes, so faults can be injected into a running demo), or empty (a healthy fleet).
    Each host gets the pool's model and GPU count unless its spec says otherwise.
    """

    def __init__(self, source: str | Mapping[str, Any] | None = None) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._spec: dict[str, Any] = {}
        self._mtime: float | None = None
        self._load(force=True)

    def _load(self, force: bool = False) -> None:
        source = self.source
        if isinstance(source, Mapping):
            if force:
                self._spec = dict(source)
            return
        text = (source or "").strip()
        if text.startswith("@"):
            path = Path(text[1:])
            try:
                mtime = path.stat().st_mtime
            except OSError:
                mtime = None
            if force or mtime != self._mtime:
                self._spec = json.loads(path.read_text()) if mtime is not None else {}
                self._mtime = mtime
        elif force:
            self._spec = json.loads(text) if text else {}

    def spec(self) -> dict[str, Any]:
        with self._lock:
            self._load()
            return self._spec

    def node(
        self, hostname: str, *, model: str | None, gpus: int | None, healed_at: float | None = None
    ) -> tuple[FakeNvml, SimulatedTools]:
        """Return the host's fake NVML and tools.

        ``healed_at`` (epoch seconds) is when a repair remediated the node: its faults are gone
        then, unless the spec file changed after it (someone injected new faults).
        """
        spec = self.spec()
        healthy = healed_at is not None and (self._mtime is None or healed_at >= self._mtime)
        if "nodes" in spec or "default" in spec:
            default = dict(spec.get("default") or {})
            node = (spec.get("nodes") or {}).get(hostname) or {}
        else:  # one plain node spec for every host
            default, node = dict(spec), {}
        if isinstance(node, list):
            node = {"faults": node}
        node = dict(node)
        outcomes = {**(default.pop("tools", None) or {}), **(node.pop("tools", None) or {})}
        base: dict[str, Any] = {}
        if model:
            base["model"] = model
        if gpus:
            base["gpus"] = gpus
        default = {**base, **default}
        if healthy:
            default.pop("faults", None)
            node.pop("faults", None)
            outcomes = {}
        fleet = {"default": default, "nodes": {hostname: node} if node else {}}
        return fake_for_host(hostname, fleet), SimulatedTools(outcomes)

    def run(self, job: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        """Run one job against the host's fake hardware and return the report to record."""
        try:
            fake, runner = self.node(job["host"], model=job.get("model"), gpus=job.get("gpus"),
                                     healed_at=job.get("heal"))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            return compact_report(_error_report(job["level"], job["host"], exc))
        options.setdefault("event_wait_ms", 0)
        return run_job(job, nvml=fake, tool_runner=runner, **options)
