"""The vocabulary every health check speaks: statuses, recommended actions and check results.

Pure Python, no Django: the node agent imports this on GPU nodes that have no portal settings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """The outcome of one check, of one GPU, or of a whole node."""

    PASS = "pass"
    WARN = "warn"
    UNKNOWN = "unknown"
    FAIL = "fail"


# Unknown ranks above warn: a reading we could not take must never let a node look healthier
# than a reading that found a mild problem (the research rule "never PASS on NotSupported").
STATUS_RANK: dict[Status, int] = {Status.PASS: 0, Status.WARN: 1, Status.UNKNOWN: 2, Status.FAIL: 3}

# CLI exit codes, fixed by the agent's contract (0 pass, 1 warn, 2 fail, 3 unknown).
EXIT_CODES: dict[Status, int] = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2, Status.UNKNOWN: 3}


class Action(StrEnum):
    """What a human or the repair workflow should do about a finding, mildest first."""

    NONE = "none"
    MONITOR = "monitor"
    INVESTIGATE = "investigate"
    RESET_WHEN_IDLE = "reset_when_idle"
    DRAIN_AND_RESET = "drain_and_reset"
    REBOOT = "reboot"
    RESEAT = "reseat"
    REPLACE_GPU = "replace_gpu"
    RMA = "rma"


ACTION_RANK: dict[Action, int] = {action: rank for rank, action in enumerate(Action)}


@dataclass
class CheckResult:
    """One judged reading: what was read, against which threshold, and what it means."""

    name: str
    status: Status
    value: Any = None
    threshold: Any = None
    message: str = ""
    action: Action = Action.NONE

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        self.action = Action(self.action)
        # A passing check never asks anyone to act; keeps summaries honest whatever the caller passed.
        if self.status is Status.PASS:
            self.action = Action.NONE

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form used in reports."""
        return {
            "name": self.name,
            "status": str(self.status),
            "value": _jsonable(self.value),
            "threshold": _jsonable(self.threshold),
            "message": self.message,
            "action": str(self.action),
        }


@dataclass
class GpuResult:
    """Every check of one GPU plus its identity."""

    index: int
    uuid: str | None = None
    serial: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def verdict(self) -> Status:
        """Return the worst status among this GPU's checks."""
        return worst_status(self.checks)

    @property
    def action(self) -> Action:
        """Return the action recommended for this GPU."""
        return recommended_action(self.checks)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form used in reports."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "serial": self.serial,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "verdict": str(self.verdict),
            "action": str(self.action),
            "checks": [check.to_dict() for check in self.checks],
        }


def worst_status(checks: Iterable[CheckResult]) -> Status:
    """Return the worst status of the checks; no checks at all is unknown, never pass."""
    statuses = [check.status for check in checks]
    if not statuses:
        return Status.UNKNOWN
    return max(statuses, key=STATUS_RANK.__getitem__)


def recommended_action(checks: Iterable[CheckResult]) -> Action:
    """Return the strongest action among the checks that share the worst status.

    A failing check's action always beats a warning's, so "reset when idle" for a warning never
    masks "reseat" for a failure.
    """
    checks = list(checks)
    if not checks:
        return Action.INVESTIGATE
    worst = worst_status(checks)
    if worst is Status.PASS:
        return Action.NONE
    candidates = [check.action for check in checks if check.status is worst]
    action = max(candidates, key=ACTION_RANK.__getitem__)
    if action is Action.NONE:
        # A non-passing verdict always carries something to do.
        return Action.INVESTIGATE if worst in (Status.FAIL, Status.UNKNOWN) else Action.MONITOR
    return action


def _jsonable(value: Any) -> Any:
    """Convert tuples, sets and enums to JSON-native values, recursively."""
    if isinstance(value, StrEnum):
        return str(value)
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else value
        return [_jsonable(item) for item in items]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


# --- wording -------------------------------------------------------------------------------------
# The node agent imports no portal code (portal.core.words), so the health library counts in words itself.


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """Return "1 path", "2 paths" (``plural`` for nouns not made by adding an "s": "processes")."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def gpus_named(indices: Iterable[int]) -> str:
    """Return "GPU 2" or "GPUs 0, 3" for GPU indices."""
    indices = list(indices)
    return f"{'GPU' if len(indices) == 1 else 'GPUs'} {', '.join(str(i) for i in indices)}"
