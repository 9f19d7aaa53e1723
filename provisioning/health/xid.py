"""XID policy, kernel-log parsing and the small state file that de-duplicates reported XIDs.

NVML's event path only sees XIDs raised while the agent waits (KDP), so the kernel log is
scanned as well; old lines stay in the log, hence the record of what was already reported (AZ).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .results import Action, CheckResult, Status, recommended_action, worst_status


@dataclass(frozen=True)
class XidPolicy:
    """How one XID is judged."""

    status: Status
    action: Action
    meaning: str


_APP = XidPolicy(Status.PASS, Action.NONE, "application fault (not a hardware problem)")

# DCGM 4.6 health mapping with our severities (research table "XID policy").
XID_POLICY: dict[int, XidPolicy] = {
    13: XidPolicy(_APP.status, _APP.action, "graphics engine exception (application fault)"),
    31: XidPolicy(_APP.status, _APP.action, "GPU memory page fault (application fault)"),
    43: XidPolicy(_APP.status, _APP.action, "GPU stopped processing (application fault)"),
    45: XidPolicy(_APP.status, _APP.action, "preemptive cleanup after an application fault"),
    68: XidPolicy(_APP.status, _APP.action, "video processor exception (application fault)"),
    109: XidPolicy(_APP.status, _APP.action, "context switch timeout (application fault)"),
    48: XidPolicy(Status.FAIL, Action.DRAIN_AND_RESET, "uncorrectable double-bit ECC error"),
    63: XidPolicy(Status.WARN, Action.RESET_WHEN_IDLE, "row remap / page retirement recorded; reset to activate"),
    64: XidPolicy(Status.FAIL, Action.REPLACE_GPU, "row remap / page retirement recording failed"),
    74: XidPolicy(Status.FAIL, Action.DRAIN_AND_RESET, "NVLink error"),
    79: XidPolicy(Status.FAIL, Action.RESEAT, "GPU has fallen off the bus"),
    92: XidPolicy(Status.WARN, Action.MONITOR, "high single-bit ECC error rate"),
    94: XidPolicy(Status.WARN, Action.RESET_WHEN_IDLE, "contained ECC error; reset the GPU when convenient"),
    95: XidPolicy(Status.FAIL, Action.DRAIN_AND_RESET, "uncontained ECC error"),
    119: XidPolicy(Status.FAIL, Action.DRAIN_AND_RESET, "GSP RPC timeout"),
    120: XidPolicy(Status.FAIL, Action.DRAIN_AND_RESET, "GSP error"),
    140: XidPolicy(Status.FAIL, Action.DRAIN_AND_RESET, "unrecovered ECC error"),
}

# An XID we have no policy for is never ignored: someone should look at it.
UNLISTED_XID = XidPolicy(Status.WARN, Action.INVESTIGATE, "XID without a configured policy")


def xid_policy(xid: int) -> XidPolicy:
    """Return the policy for an XID number."""
    return XID_POLICY.get(xid, UNLISTED_XID)


# e.g. "[ 1234.5678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off..."
_XID_LINE = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2})(?:\.[0-7])?\):\s*"
    r"(?P<xid>\d+)\s*,?\s*(?P<detail>.*)$"
)


# The process an XID line names: "pid=48213, name=train.py, " ("pid='<unknown>', name=<unknown>, " when none).
# The same pattern as portal.core.redact.XID_PROCESS (the agent imports no portal code; a test checks they agree).
_XID_PROCESS = re.compile(r"\bpid=[^,]*,\s*name=[^,]*(?:,\s*|$)")


def without_process(detail: str) -> str:
    """Return an XID line's detail without the process it names: that is the work of the team on the node
    then, and a report carrying the XID may be read by another team."""
    return _XID_PROCESS.sub("", detail, count=1).strip()


@dataclass(frozen=True)
class KernelXid:
    """One XID line found in the kernel log."""

    pci: tuple[int, int, int]  # (domain, bus, device)
    xid: int
    detail: str
    line: str

    @property
    def key(self) -> str:
        """Return the de-duplication key: the line itself, so a repeated identical line counts once."""
        return hashlib.sha256(self.line.strip().encode()).hexdigest()[:32]


def pci_key(domain: int, bus: int, device: int) -> tuple[int, int, int]:
    """Return the comparable form of a PCI address."""
    return (int(domain), int(bus), int(device))


def format_pci(pci: tuple[int, int, int]) -> str:
    """Format a PCI address the way NVML spells bus ids."""
    return f"{pci[0]:08x}:{pci[1]:02x}:{pci[2]:02x}.0"


def parse_kernel_log(lines: Iterable[str]) -> list[KernelXid]:
    """Return the XID lines of a dmesg or journal dump, identical lines once, in order."""
    found: dict[str, KernelXid] = {}
    for raw in lines:
        line = raw.rstrip("\n")
        match = _XID_LINE.search(line)
        if not match:
            continue
        domain, bus, device = (int(part, 16) for part in match["pci"].split(":"))
        entry = KernelXid(pci_key(domain, bus, device), int(match["xid"]), match["detail"].strip(), line.strip())
        found.setdefault(entry.key, entry)
    return list(found.values())


class KernelLogUnavailable(RuntimeError):
    """Raised when no kernel log source could be read."""


def read_system_kernel_log(timeout_s: float = 10.0) -> list[str]:
    """Return the current kernel log lines from dmesg, or from journald when dmesg is not permitted.

    Raise KernelLogUnavailable with the reasons when neither works, so the caller reports the
    XID history as unknown instead of clean.
    """
    reasons: list[str] = []
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager", "-o", "short-monotonic"]):
        if shutil.which(argv[0]) is None:
            reasons.append(f"{argv[0]} not installed")
            continue
        try:
            done = subprocess.run(  # noqa: S603 - fixed argv, no shell
                argv, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(f"{argv[0]}: {exc}")
            continue
        if done.returncode == 0:
            return done.stdout.splitlines()
        reasons.append(f"{argv[0]} exited {done.returncode}: {done.stderr.strip()[:200]}")
    raise KernelLogUnavailable("; ".join(reasons))


@dataclass
class HealthState:
    """What the agent remembers between runs: XIDs already reported and counter baselines.

    Counters (PCIe replays, NVLink errors, aggregate ECC) only mean something as deltas, so the
    last reading of each is kept per GPU UUID with its time.
    """

    reported_xids: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    counters: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    max_xids: int = 5000
    # XIDs sent in a report the portal has not yet said it stored, by receipt (the check's id): they
    # count as reported only once it has (accept); until then every run reports them again.
    pending_xids: dict[str, list[str]] = field(default_factory=dict)
    # Likewise the counter readings of a run sent under a receipt, {receipt: {uuid: {name: [value, time]}}}:
    # they become the baseline only once the portal stored the report (accept); until then every run is
    # judged against the last accepted baseline, so an increase a lost report carried is reported again.
    pending_counters: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    max_receipts: int = 100

    def is_reported(self, key: str) -> bool:
        """Tell whether this XID line was already reported."""
        return key in self.reported_xids

    def mark_reported(self, key: str) -> None:
        """Remember an XID line, forgetting the oldest beyond max_xids."""
        self.reported_xids[key] = None
        while len(self.reported_xids) > self.max_xids:
            del self.reported_xids[next(iter(self.reported_xids))]

    def hold(self, receipt: str, keys: Iterable[str],
             counters: Mapping[str, Mapping[str, Sequence[float]]] | None = None) -> None:
        """Remember the XIDs and counter readings ({uuid: readings}) sent under receipt, forgetting the oldest
        receipts beyond max_receipts (nothing is lost: their XIDs were never marked reported and their
        readings never became the baseline, so a later run reports both again)."""
        self._keep(self.pending_xids, receipt, list(keys))
        self._keep(self.pending_counters, receipt, {
            uuid: {name: [float(v) for v in r] for name, r in values.items()}
            for uuid, values in (counters or {}).items() if uuid and values})

    def _keep(self, pending: dict[str, Any], receipt: str, held: Any) -> None:
        """Hold a non-empty held under receipt as the newest, forgetting the oldest receipts beyond max_receipts."""
        if not held:
            return
        pending.pop(receipt, None)
        pending[receipt] = held
        while len(pending) > self.max_receipts:
            del pending[next(iter(pending))]

    def holds(self, receipt: str) -> bool:
        """Tell whether anything sent under receipt waits for the portal's word."""
        return receipt in self.pending_xids or receipt in self.pending_counters

    def accept(self, receipt: str) -> None:
        """The portal stored the report sent under receipt: its XIDs are reported now and its counter
        readings the baseline. Readings held before it are dropped: this report was judged against the
        same or an older baseline, so it carried their increases too. A reading never replaces a newer one."""
        for key in self.pending_xids.pop(receipt, []):
            self.mark_reported(key)
        if receipt not in self.pending_counters:
            return
        for held in list(self.pending_counters):
            readings = self.pending_counters.pop(held)
            if held == receipt:
                for uuid, values in readings.items():
                    current = self.counters.setdefault(uuid, {})
                    for name, reading in values.items():
                        if name not in current or len(current[name]) < 2 or reading[1] >= current[name][1]:
                            current[name] = reading
                break

    def baseline(self, uuid: str | None) -> dict[str, list[float]]:
        """Return the previous counter readings of a GPU as {name: [value, unix_time]}."""
        if not uuid:
            return {}
        return dict(self.counters.get(uuid, {}))

    def record(self, uuid: str | None, readings: dict[str, list[float]]) -> None:
        """Store this run's counter readings as the next baseline."""
        if uuid and readings:
            self.counters.setdefault(uuid, {}).update(readings)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form written to the state file."""
        return {"version": 1, "reported_xids": list(self.reported_xids), "counters": self.counters,
                "pending_xids": self.pending_xids, "pending_counters": self.pending_counters}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HealthState:
        """Build a state from its JSON form."""
        pending = data.get("pending_xids")
        held = data.get("pending_counters")
        return cls(
            reported_xids=dict.fromkeys(data.get("reported_xids", [])),
            counters={str(k): dict(v) for k, v in data.get("counters", {}).items()},
            pending_xids={str(k): [str(key) for key in v] for k, v in pending.items() if isinstance(v, list)}
            if isinstance(pending, dict) else {},
            pending_counters={str(k): {str(uuid): dict(r) for uuid, r in v.items() if isinstance(r, dict)}
                              for k, v in held.items() if isinstance(v, dict)}
            if isinstance(held, dict) else {},
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HealthState:
        """Read the state file; a missing or unreadable file starts afresh (worst case: one repeat)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return cls()
        return cls.from_dict(data) if isinstance(data, dict) else cls()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state file atomically, so a crash never leaves half a file."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".health-state-")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(self.to_dict(), handle)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def summarize_xids(xids: Sequence[int]) -> tuple[Status, Action]:
    """Return the worst status and its action for a set of XIDs (none found: pass)."""
    if not xids:
        return Status.PASS, Action.NONE
    results = [CheckResult("xid", xid_policy(x).status, action=xid_policy(x).action) for x in xids]
    return worst_status(results), recommended_action(results)
