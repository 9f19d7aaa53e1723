"""Health records: one row per check of one node, and the repair a failing check opens."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from .choices import (
    OPEN_CHECK_STATUSES,
    OPEN_REPAIR_STATES,
    CheckLevel,
    CheckStatus,
    CheckTrigger,
    RecommendedAction,
    RepairState,
    Verdict,
)

__all__ = ["HealthCheck", "Repair"]


class HealthCheck(models.Model):
    """One level of checks on one node: queued here, run by the node's agent, its report posted back."""

    node = models.ForeignKey("reservations.Node", on_delete=models.CASCADE, related_name="health_checks")
    # The booking the check was run for (acceptance, or a tenant's request); null for fleet checks.
    reservation = models.ForeignKey(
        "reservations.Reservation", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    level = models.CharField(max_length=8, choices=CheckLevel.choices)
    trigger = models.CharField(max_length=12, choices=CheckTrigger.choices)
    status = models.CharField(max_length=8, choices=CheckStatus.choices, default=CheckStatus.QUEUED)
    verdict = models.CharField(max_length=8, choices=Verdict.choices, blank=True, default="")
    recommended_action = models.CharField(max_length=16, choices=RecommendedAction.choices, blank=True, default="")
    summary = models.CharField(max_length=500, blank=True, default="")
    # Per GPU: {index, uuid, serial, name, pci_bus_id, verdict, action, checks: [...], passed: [...]}.
    gpu_results = models.JSONField(default=list, blank=True)
    # The rest of the agent's report (node checks, parts run, problems, versions); see report.schema.json.
    report = models.JSONField(default=dict, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")
    agent_queue = models.CharField(max_length=270, blank=True, default="")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # When the verdict's consequences (drain, repair, events) were applied; null while they are due.
    handled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["node", "-created_at"], name="health_check_node_recent"),
            models.Index(
                fields=["node", "-finished_at"],
                condition=Q(status=CheckStatus.DONE),
                name="health_check_node_done",
            ),
            models.Index(fields=["created_at"], condition=Q(status__in=OPEN_CHECK_STATUSES), name="health_check_open"),
            models.Index(
                fields=["finished_at"],
                condition=Q(handled_at__isnull=True, status__in=[CheckStatus.DONE, CheckStatus.ERROR]),
                name="health_check_unhandled",
            ),
            models.Index(fields=["reservation", "node"], name="health_check_reservation"),
            # The lists' order (API, admin): a page reads 50 rows off the index instead of sorting them all.
            models.Index(fields=["-created_at", "-id"], name="health_check_recent"),
            # /metrics' portal_node_health: each node's newest check with a verdict, one probe per node.
            models.Index(F("node"), F("finished_at").desc(nulls_last=True), F("id").desc(),
                         condition=~Q(verdict=""), name="health_check_node_verdict"),
        ]
        constraints = [
            # One open check per node, level and booking: a second request reuses the first
            # (INSERT … ON CONFLICT DO NOTHING), so impatient clicks cannot pile up work on a node.
            models.UniqueConstraint(
                fields=["node", "level", "reservation"],
                condition=Q(status__in=OPEN_CHECK_STATUSES),
                nulls_distinct=False,
                name="%(app_label)s_%(class)s_one_open_per_node_level",
                violation_error_message="That node already has an open check of this level.",
            ),
            models.CheckConstraint(
                condition=Q(status__in=[CheckStatus.QUEUED, CheckStatus.RUNNING], verdict="")
                | Q(status__in=[CheckStatus.DONE, CheckStatus.ERROR]) & ~Q(verdict=""),
                name="%(app_label)s_%(class)s_verdict_when_finished",
                violation_error_message="A finished check has a verdict; an open one has none.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.level} check #{self.pk} of node {self.node_id} ({self.verdict or self.status})"

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_CHECK_STATUSES

    @property
    def problems(self) -> list[dict[str, Any]]:
        return list(self.report.get("problems") or [])

    def full_report(self) -> dict[str, Any]:
        """Return the stored report with its per-GPU results put back."""
        return {**self.report, "gpus": self.gpu_results}


class Repair(models.Model):
    """A node taken out of service by a failing check, through recommend → … → rejoin (or failed)."""

    node = models.ForeignKey("reservations.Node", on_delete=models.CASCADE, related_name="repairs")
    state = models.CharField(max_length=12, choices=RepairState.choices, default=RepairState.RECOMMENDED)
    reason = models.CharField(max_length=500)
    triggering_check = models.ForeignKey(
        HealthCheck, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    recommended_action = models.CharField(max_length=16, choices=RecommendedAction.choices, blank=True, default="")
    retest_check = models.ForeignKey(HealthCheck, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # When a person last started remediating (the simulated fleet treats the node as fixed from then).
    remediated_at = models.DateTimeField(null=True, blank=True)
    # What happened to the node's bookings when it was drained (node_replace_allocations' outcomes).
    outcomes = models.JSONField(default=list, blank=True)
    # Every step: [{"state", "at", "actor", "note"}] (actor null = automatic); also in the audit log.
    steps = models.JSONField(default=list, blank=True)
    opened_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    opened_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]
        indexes = [models.Index(fields=["state"], condition=Q(state__in=OPEN_REPAIR_STATES), name="repair_open")]
        constraints = [
            models.UniqueConstraint(
                fields=["node"],
                condition=Q(state__in=OPEN_REPAIR_STATES),
                name="%(app_label)s_%(class)s_one_open_per_node",
                violation_error_message="That node already has an open repair.",
            ),
            models.CheckConstraint(
                condition=Q(state__in=OPEN_REPAIR_STATES, closed_at__isnull=True)
                | ~Q(state__in=OPEN_REPAIR_STATES) & Q(closed_at__isnull=False),
                name="%(app_label)s_%(class)s_closed_when_done",
                violation_error_message="A closed repair has a closing time; an open one has none.",
            ),
        ]

    def __str__(self) -> str:
        return f"repair #{self.pk} of node {self.node_id} ({self.state})"

    @property
    def is_open(self) -> bool:
        return self.state in OPEN_REPAIR_STATES
