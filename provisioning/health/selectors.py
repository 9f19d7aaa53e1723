"""Health reads, every one through the tenant scope.

A tenant user sees checks of the nodes its reservations hold or held (active allocations, and
the ones a failure replaced, so the team can see why a node was swapped) while the booking is
live; checks another tenant asked for (bound to that tenant's booking) never show. Staff see
everything. The scope comes from ``Allocation.objects.for_user`` / ``Reservation.objects.for_user``.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.contrib.postgres.fields.ranges import RangeStartsWith
from django.db.models import Exists, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from portal.core.redact import without_processes, without_secrets
from reservations.choices import HOLDING_STATUSES, AllocationKind
from reservations.models import Allocation, Node, Reservation

from ..selectors import failed_teardown_hold
from .choices import OPEN_REPAIR_STATES, CheckStatus, RepairState, Verdict
from .models import HealthCheck, Repair

__all__ = [
    "visible_node_ids",
    "checks_for_user",
    "check_as_seen_by",
    "latest_checks",
    "nodes_with_health",
    "cluster_node_ids",
    "cluster_checks_q",
    "cluster_health",
    "fleet_summary",
    "open_repairs",
    "booking_holds_nodes",
    "may_check_cluster",
    "can_request_cluster_checks",
    "rejoined_node_held_for",
]


def _held_allocations(user) -> QuerySet[Allocation]:
    """The user's tenants' allocations that held (or hold) their node for a while: active ones, and the
    part before the cut of those a node swap released."""
    # A swap moving a booking whole before its start (replaced_at at or before the period's start)
    # left it a released row with its booked window, although its team never held the node in it.
    return (
        Allocation.objects.for_user(user)
        .filter(kind=AllocationKind.RESERVATION, reservation__status__in=HOLDING_STATUSES)
        .filter(Q(active=True) | Q(replaced_at__gt=RangeStartsWith("period")))
    )


def visible_node_ids(user) -> QuerySet | None:
    """Return a subquery of node ids the user may see health of; None means every node (staff)."""
    if not getattr(user, "is_authenticated", False):
        return Node.objects.none().values("pk")
    if user.is_staff:
        return None
    return _held_allocations(user).values("node_id")


def checks_for_user(user) -> QuerySet[HealthCheck]:
    """Return the checks the user may see (newest first), with node and pool loaded.

    A fleet check (scheduled, staff: no booking) shows only when it ran while one of the user's
    bookings held the node: one from another tenant's time on it reads that tenant's processes.
    """
    qs = HealthCheck.objects.select_related("node__pool", "requested_by")
    nodes = visible_node_ids(user)
    if nodes is None:
        return qs
    own = Reservation.objects.for_user(user).values("pk")
    held_then = _held_allocations(user).filter(
        Q(active=True) | Q(replaced_at__gt=OuterRef("created_at")),
        node_id=OuterRef("node_id"), period__contains=OuterRef("created_at"),
    )
    return qs.filter(node_id__in=nodes).filter(
        Q(reservation_id__in=own) | Q(Exists(held_then), reservation__isnull=True)
    )


def _told(text: str) -> str:
    """A check's text as a tenant reads it: no process (another team's work), no credential a tool's output or an
    exception's text carried (a URL's password, a token); staff read it as stored."""
    return without_secrets(without_processes(text), limit=None)


def _reading_as_seen_by_a_tenant(result: Any) -> Any:
    """One check result (a GPU's or the node's) without any process it names: compute processes counted
    (``{"count": n}``), process ids and an XID line's "pid=…, name=…" left out of its message and details."""
    if not isinstance(result, Mapping):
        return result
    seen = dict(result)
    if isinstance(seen.get("message"), str):
        seen["message"] = _told(seen["message"])
    value = seen.get("value")
    if seen.get("name") == "compute_processes" and value is not None:
        # A list of {pid, used_mib} on an idle node (strays), {"count": n} on a node in use (newer agents).
        count = value.get("count") if isinstance(value, Mapping) else len(value) if isinstance(value, list) else 0
        seen["value"] = {"count": count if isinstance(count, int) and not isinstance(count, bool) else 0}
    elif isinstance(value, list):
        seen["value"] = [
            {**entry, "detail": _told(entry["detail"])}
            if isinstance(entry, Mapping) and isinstance(entry.get("detail"), str) else entry
            for entry in value
        ]
    return seen


def check_as_seen_by(user, check: HealthCheck | None) -> HealthCheck | None:
    """Return the check as the user may read it: staff read it whole; anyone else reads an unsaved copy
    whose readings, messages, problems and summary name no process and carry no credential (``_told``).

    A check a team reads may have seen another team's work: the acceptance gate checks an idle node
    for the booking that follows, and processes left there (strays, another team's) are named in the
    readings for staff; the gate checks a node still in use for the next booking too. Newer agents
    count processes on a node in use and the portal strips them from the problems it stores, but rows
    stored before (and an older agent's readings) still name them: this guard, on every tenant-facing
    output (API, pages), applies whatever is stored. Never save the copy.
    """
    if check is None or getattr(user, "is_staff", False):
        return check
    seen = copy.copy(check)
    seen.gpu_results = [
        {**gpu, "checks": [_reading_as_seen_by_a_tenant(c) for c in gpu.get("checks") or []]}
        if isinstance(gpu, Mapping) else gpu
        for gpu in check.gpu_results or []
    ]
    report = dict(check.report or {})
    if isinstance(report.get("node_checks"), list):
        report["node_checks"] = [_reading_as_seen_by_a_tenant(c) for c in report["node_checks"]]
    if isinstance(report.get("problems"), list):
        report["problems"] = [
            {**p, "message": _told(p["message"])}
            if isinstance(p, Mapping) and isinstance(p.get("message"), str) else p
            for p in report["problems"]
        ]
    seen.report = report
    seen.summary = _told(check.summary or "")
    seen.error = _told(check.error or "")
    seen.save = _never_saved  # the redacted copy must never overwrite the stored report
    return seen


def _never_saved(*args, **kwargs):
    raise RuntimeError("a check as a tenant reads it (check_as_seen_by) is a redacted copy: never save it")


def latest_checks(node_ids, *, user=None, done_only: bool = True) -> dict[int, HealthCheck]:
    """Return each node's newest finished (or, done_only False, any) check the user may see."""
    qs = checks_for_user(user) if user is not None else HealthCheck.objects.select_related("node__pool")
    qs = qs.filter(node_id__in=list(node_ids))
    if done_only:
        qs = qs.filter(status=CheckStatus.DONE)
        order = ["node_id", "-finished_at", "-pk"]
    else:
        order = ["node_id", "-created_at", "-pk"]
    return {check.node_id: check for check in qs.order_by(*order).distinct("node_id")}


def nodes_with_health(qs: QuerySet[Node]) -> QuerySet[Node]:
    """Annotate nodes with their newest finished check (health_verdict, health_checked_at,
    health_check_id, health_summary) and whether a check is running or a repair open.

    For pages listing many nodes (the fleet timeline): one statement, each node's lookup
    served by the ``health_check_node_done`` index. Staff pages only (no tenant scope).
    """
    newest = HealthCheck.objects.filter(node_id=OuterRef("pk"), status=CheckStatus.DONE).order_by(
        "-finished_at", "-pk"
    )
    return qs.annotate(
        health_verdict=Subquery(newest.values("verdict")[:1]),
        health_checked_at=Subquery(newest.values("finished_at")[:1]),
        health_check_id=Subquery(newest.values("pk")[:1]),
        health_summary=Subquery(newest.values("summary")[:1]),
        health_running=Exists(
            HealthCheck.objects.filter(node_id=OuterRef("pk"), status__in=[CheckStatus.QUEUED, CheckStatus.RUNNING])
        ),
        health_repair_id=Subquery(
            Repair.objects.filter(node_id=OuterRef("pk"), state__in=OPEN_REPAIR_STATES).values("pk")[:1]
        ),
    )


def cluster_node_ids(cluster) -> list[int]:
    """Return the nodes a cluster's reservation holds (active allocations), by hostname."""
    return list(
        Allocation.objects.filter(reservation_id=cluster.reservation_id, active=True)
        .order_by("node__hostname").values_list("node_id", flat=True)
    )


def cluster_checks_q(reservation) -> Q:
    """Checks of a cluster: those run for its booking, and its nodes' checks during its window."""
    node_ids = Allocation.objects.filter(reservation=reservation).filter(
        Q(active=True) | Q(replaced_at__isnull=False)
    ).values("node_id")
    return Q(reservation_id=reservation.pk) | Q(
        node_id__in=node_ids, created_at__gte=reservation.start, created_at__lt=reservation.end
    )


def cluster_health(cluster, *, user) -> list[dict[str, Any]]:
    """Return [{node, latest (finished check or None), open (queued/running check or None)}]
    for the cluster's nodes, as the user may see them (nothing for another tenant's cluster)."""
    from provisioning.models import VirtualCluster  # the cluster app may load after this one

    if not VirtualCluster.objects.for_user(user).filter(pk=cluster.pk).exists():
        return []
    node_ids = cluster_node_ids(cluster)
    nodes = {n.pk: n for n in Node.objects.filter(pk__in=node_ids).select_related("pool")}
    done = latest_checks(node_ids, user=user)
    newest = latest_checks(node_ids, user=user, done_only=False)
    rows = []
    for node_id in node_ids:
        latest_any = newest.get(node_id)
        rows.append({
            "node": nodes[node_id],
            "latest": check_as_seen_by(user, done.get(node_id)),
            "open": check_as_seen_by(user, latest_any) if latest_any is not None and latest_any.is_open else None,
        })
    return rows


def fleet_summary() -> dict[str, Any]:
    """Count nodes by their newest verdict (staff): {"verdicts": {verdict: n}, "unchecked": n, "total": n}."""
    nodes = nodes_with_health(Node.objects.exclude(state="retired")).values_list("health_verdict", flat=True)
    counts = Counter(v or "unchecked" for v in nodes)
    return {
        "verdicts": {v: counts.get(v, 0) for v in Verdict.values},
        "unchecked": counts.get("unchecked", 0),
        "total": sum(counts.values()),
        "running": HealthCheck.objects.filter(status__in=[CheckStatus.QUEUED, CheckStatus.RUNNING]).count(),
        "at": timezone.now(),
    }


def open_repairs() -> QuerySet[Repair]:
    return Repair.objects.filter(state__in=OPEN_REPAIR_STATES).select_related("node__pool", "triggering_check")


def booking_holds_nodes(reservation: Reservation, now: datetime | None = None) -> bool:
    """Tell whether the booking holds its nodes now (checks on demand run only then): a holding
    status, and its window running. Before its start the nodes may still serve someone else."""
    now = now or timezone.now()
    return reservation.status in HOLDING_STATUSES and reservation.start <= now < reservation.end


def may_check_cluster(user, cluster) -> bool:
    """Tell whether the user's role lets them run checks on the cluster: staff, or a lead/member of its tenant."""
    from tenants.choices import BOOKING_ROLES
    from tenants.models import Membership

    if not getattr(user, "is_authenticated", False):
        return False
    if user.is_staff:
        return True
    return Membership.objects.filter(user=user, tenant_id=cluster.tenant_id, role__in=BOOKING_ROLES).exists()


def can_request_cluster_checks(user, cluster) -> bool:
    """Tell whether to offer the check button: to whoever may check the cluster, while its booking
    holds its nodes (what cluster_health_checks_request accepts; otherwise it is refused)."""
    return booking_holds_nodes(cluster.reservation) and may_check_cluster(user, cluster)


def rejoined_node_held_for(repair: Repair) -> int | None:
    """For a rejoined repair whose node did not go back to service because a failed teardown still holds it
    (see services._node_follows), the cluster whose teardown holds it; else None."""
    if repair.state != RepairState.REJOINED:
        return None
    return failed_teardown_hold(Node.objects.get(pk=repair.node_id))
