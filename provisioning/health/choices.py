"""Levels, triggers, statuses, verdicts, actions and repair states of the health records."""

from __future__ import annotations

from django.db import models

from .results import Action, Status

__all__ = [
    "CheckLevel",
    "CheckTrigger",
    "CheckStatus",
    "Verdict",
    "RecommendedAction",
    "RepairState",
    "OPEN_CHECK_STATUSES",
    "LEVEL_RANK",
    "OPEN_REPAIR_STATES",
    "REPAIR_TRANSITIONS",
    "ACCEPTABLE_VERDICTS",
]


class CheckLevel(models.TextChoices):
    QUICK = "quick", "Quick (read-only, safe while jobs run)"
    MEDIUM = "medium", "Medium (node idle: DCGM diag r2, nvbandwidth, NCCL)"
    FULL = "full", "Full (acceptance / burn-in, network between nodes)"


# A check of a higher level includes everything a lower one reads.
LEVEL_RANK: dict[str, int] = {CheckLevel.QUICK: 0, CheckLevel.MEDIUM: 1, CheckLevel.FULL: 2}


class CheckTrigger(models.TextChoices):
    SCHEDULE = "schedule", "Schedule"
    ACCEPTANCE = "acceptance", "Acceptance (before hand-over)"
    TENANT = "tenant", "Tenant"
    REPAIR = "repair", "Repair re-test"
    STAFF = "staff", "Staff"


class CheckStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    ERROR = "error", "Error"


OPEN_CHECK_STATUSES = (CheckStatus.QUEUED, CheckStatus.RUNNING)


class Verdict(models.TextChoices):
    """The agent's node verdicts (results.Status), mildest first; unknown ranks above warn."""

    PASS = Status.PASS.value, "Pass"
    WARN = Status.WARN.value, "Warn"
    UNKNOWN = Status.UNKNOWN.value, "Unknown"
    FAIL = Status.FAIL.value, "Fail"


# What lets a node be handed over or rejoin: a warning is flagged but keeps scheduling.
ACCEPTABLE_VERDICTS = (Verdict.PASS, Verdict.WARN)

RecommendedAction = models.TextChoices(
    "RecommendedAction", [(a.name, (a.value, a.value.replace("_", " ").capitalize())) for a in Action]
)


class RepairState(models.TextChoices):
    RECOMMENDED = "recommended", "Recommended"
    ACCEPTED = "accepted", "Accepted"
    CORDONED = "cordoned", "Cordoned and drained"
    REMEDIATING = "remediating", "Remediating"
    RETESTING = "retesting", "Re-testing"
    REJOINED = "rejoined", "Rejoined"
    FAILED = "failed", "Failed (out of service)"


OPEN_REPAIR_STATES = (
    RepairState.RECOMMENDED,
    RepairState.ACCEPTED,
    RepairState.CORDONED,
    RepairState.REMEDIATING,
    RepairState.RETESTING,
)

# recommend → accept → cordon/drain → remediate → re-test → rejoin; any open state may fail.
REPAIR_TRANSITIONS: dict[str, tuple[str, ...]] = {
    RepairState.RECOMMENDED: (RepairState.ACCEPTED, RepairState.FAILED),
    RepairState.ACCEPTED: (RepairState.CORDONED, RepairState.FAILED),
    RepairState.CORDONED: (RepairState.REMEDIATING, RepairState.FAILED),
    RepairState.REMEDIATING: (RepairState.RETESTING, RepairState.FAILED),
    # A failed re-test sends the repair back to remediation.
    RepairState.RETESTING: (RepairState.REJOINED, RepairState.REMEDIATING, RepairState.FAILED),
    RepairState.REJOINED: (),
    RepairState.FAILED: (),
}
