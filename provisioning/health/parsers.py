"""Parsers for the outputs of dcgmi diag, nvbandwidth, nccl-tests and perftest's ib_write_bw.

Each parser takes the tool's stdout as text and returns plain data; judging against
thresholds happens in tools.py. A parser raises ValueError when the text holds no result at all.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# --- dcgmi diag --json ---------------------------------------------------------------------------

_DCGM_STATUS = {
    "pass": "pass",
    "fail": "fail",
    "warn": "warn",
    "warning": "warn",
    "skip": "skip",
    "skipped": "skip",
    "not run": "skip",
    "notrun": "skip",
}


@dataclass(frozen=True)
class DcgmTestResult:
    """One entity's result of one DCGM diagnostic test."""

    category: str
    test: str
    gpu: int | None
    status: str  # pass | fail | warn | skip
    messages: tuple[str, ...] = ()
    error_ids: tuple[int, ...] = ()


@dataclass
class DcgmDiag:
    """A parsed dcgmi diag run."""

    version: str | None
    results: list[DcgmTestResult] = field(default_factory=list)
    runtime_error: str | None = None


def _json_object(text: str) -> Any:
    # dcgmi and nvbandwidth may print banner lines around the JSON document.
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("no JSON object in output")
    return json.loads(text[start : end + 1])


def _gpu_ids(result: dict[str, Any]) -> list[int | None]:
    if "entity_id" in result:  # DCGM 4.x
        group = str(result.get("entity_group", "GPU")).upper()
        return [int(result["entity_id"])] if group == "GPU" else [None]
    for key in ("gpu_id", "gpu_ids"):  # DCGM 3.x spells it either way, as a string
        if key in result and str(result[key]).strip():
            return [int(part) for part in str(result[key]).split(",") if part.strip()]
    return [None]


def parse_dcgmi_diag(text: str) -> DcgmDiag:
    """Parse `dcgmi diag -r N --json` from DCGM 3.x ("DCGM GPU Diagnostic") or 4.x ("DCGM Diagnostic")."""
    data = _json_object(text)
    root = data.get("DCGM Diagnostic") or data.get("DCGM GPU Diagnostic")
    if not isinstance(root, dict):
        raise ValueError("not a dcgmi diag JSON document")
    metadata = data.get("metadata") or {}
    version = metadata.get("version") or root.get("version") or data.get("version")
    diag = DcgmDiag(version=version, runtime_error=root.get("runtime_error"))
    for category in root.get("test_categories", []):
        category_name = str(category.get("category", ""))
        for test in category.get("tests", []):
            test_name = str(test.get("name", ""))
            for result in test.get("results", []):
                status = _DCGM_STATUS.get(str(result.get("status", "")).strip().lower(), "skip")
                warnings = result.get("warnings") or []
                messages = tuple(str(w.get("warning", "")) for w in warnings if isinstance(w, dict))
                if result.get("info"):
                    info = result["info"]
                    messages += tuple(info) if isinstance(info, list) else (str(info),)
                error_ids = tuple(int(w["error_id"]) for w in warnings if isinstance(w, dict) and "error_id" in w)
                for gpu in _gpu_ids(result):
                    diag.results.append(DcgmTestResult(category_name, test_name, gpu, status, messages, error_ids))
    if not diag.results and diag.runtime_error is None:
        raise ValueError("dcgmi diag JSON holds no test results")
    return diag


# --- nvbandwidth ---------------------------------------------------------------------------------


@dataclass
class BandwidthMatrix:
    """One nvbandwidth testcase: rows of GB/s values, None where N/A (e.g. the diagonal)."""

    name: str
    description: str = ""
    rows: list[list[float | None]] = field(default_factory=list)
    status: str = "passed"
    message: str = ""

    def values(self) -> list[float]:
        """Return every measured value."""
        return [v for row in self.rows for v in row if v is not None]


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None  # "N/A"


def parse_nvbandwidth(text: str) -> dict[str, BandwidthMatrix]:
    """Parse nvbandwidth's text output (or its -j JSON) into {testcase: matrix}."""
    if text.lstrip().startswith("{"):
        return _parse_nvbandwidth_json(text)
    tests: dict[str, BandwidthMatrix] = {}
    current: BandwidthMatrix | None = None
    expecting_header = False
    for raw in text.splitlines():
        line = raw.strip()
        running = re.match(r"^Running (\S+?)\.?$", line)
        if running:
            current = tests.setdefault(running[1], BandwidthMatrix(running[1]))
            expecting_header = False
            continue
        if current is None or not line:
            continue
        status = re.match(r"^(Waived|Error|ERROR|Not Found)\s*:?\s*(.*)$", line)
        if status and not current.rows:
            current.status = status[1].lower()
            current.message = status[2]
            continue
        if "bandwidth (GB/s)" in line:
            current.description = line
            expecting_header = True
            continue
        tokens = line.split()
        if expecting_header and all(token.isdigit() for token in tokens):
            expecting_header = False
            continue
        if tokens[0].isdigit() and current.description and len(tokens) > 1:
            current.rows.append([_number(token) for token in tokens[1:]])
            continue
        if line.startswith("SUM "):
            current = None
    found = {name: matrix for name, matrix in tests.items() if matrix.rows or matrix.status != "passed"}
    if not found:
        raise ValueError("no nvbandwidth testcase results in output")
    return found


def _parse_nvbandwidth_json(text: str) -> dict[str, BandwidthMatrix]:
    root = _json_object(text).get("nvbandwidth", {})
    tests: dict[str, BandwidthMatrix] = {}
    for case in root.get("testcases", []):
        matrix = BandwidthMatrix(
            str(case.get("name")),
            str(case.get("bandwidth_description", "")),
            [[_number(str(v)) for v in row] for row in case.get("bandwidth_matrix", [])],
            str(case.get("status", "")).lower() or "passed",
            str(case.get("error", "")),
        )
        tests[matrix.name] = matrix
    if not tests:
        raise ValueError("no nvbandwidth testcases in JSON output")
    return tests


# --- nccl-tests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NcclRow:
    """One message size of an nccl-tests run, out-of-place and in-place."""

    size_bytes: int
    oop_busbw: float
    oop_wrong: float | None
    ip_busbw: float
    ip_wrong: float | None


@dataclass
class NcclResult:
    """A parsed nccl-tests run (all_reduce_perf and friends)."""

    rows: list[NcclRow] = field(default_factory=list)
    avg_busbw: float | None = None
    out_of_bounds: int | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def wrong(self) -> int:
        """Return how many result rows report corrupted data."""
        return sum(1 for r in self.rows for w in (r.oop_wrong, r.ip_wrong) if w is not None and w > 0)

    @property
    def peak_row(self) -> NcclRow | None:
        """Return the row of the largest message size, the one that reaches bus peak (NCCL)."""
        return max(self.rows, key=lambda r: r.size_bytes) if self.rows else None


def _wrong(token: str) -> float | None:
    return None if token.upper() == "N/A" else float(token)


def parse_nccl_tests(text: str) -> NcclResult:
    """Parse nccl-tests output: data rows end with time/algbw/busbw/#wrong, out-of-place then in-place."""
    result = NcclResult()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            avg = re.search(r"Avg bus bandwidth\s*:\s*([\d.]+)", line)
            if avg:
                result.avg_busbw = float(avg[1])
            oob = re.search(r"Out of bounds values\s*:\s*(\d+)\s*(\w+)", line)
            if oob:
                result.out_of_bounds = int(oob[1])
                if oob[2].upper() != "OK":
                    result.failures.append(line)
            continue
        if re.search(r"\b(FAILED|NCCL failure|Test failure|CUDA failure)\b", line):
            result.failures.append(line)
            continue
        tokens = line.split()
        if len(tokens) < 12 or not tokens[0].isdigit():
            continue
        try:
            tail = tokens[-8:]
            result.rows.append(
                NcclRow(int(tokens[0]), float(tail[2]), _wrong(tail[3]), float(tail[6]), _wrong(tail[7]))
            )
        except ValueError:
            continue
    if not result.rows and not result.failures:
        raise ValueError("no nccl-tests result rows in output")
    return result


# --- perftest ib_write_bw ------------------------------------------------------------------------


@dataclass(frozen=True)
class IbBandwidth:
    """A parsed ib_write_bw client run, in Gb/s."""

    size_bytes: int
    iterations: int
    peak_gbps: float
    average_gbps: float
    device: str | None = None


def parse_ib_write_bw(text: str) -> IbBandwidth:
    """Parse perftest output; MB/sec reports (no --report_gbits) are converted to Gb/s."""
    unit_gbits = None
    device = None
    lines = text.splitlines()
    for index, raw in enumerate(lines):
        line = raw.strip()
        dev = re.search(r"Device\s*:\s*(\S+)", line)
        if dev:
            device = dev[1]
        if line.startswith("#bytes") and "BW average" in line:
            unit_gbits = "Gb/sec" in line
            for data in lines[index + 1 :]:
                tokens = data.split()
                if len(tokens) >= 4 and tokens[0].isdigit():
                    peak, average = float(tokens[2]), float(tokens[3])
                    if not unit_gbits:
                        # perftest's MB is 2^20 bytes
                        peak, average = peak * 8 * 2**20 / 1e9, average * 8 * 2**20 / 1e9
                    return IbBandwidth(int(tokens[0]), int(tokens[1]), peak, average, device)
    raise ValueError("no ib_write_bw result row in output")
