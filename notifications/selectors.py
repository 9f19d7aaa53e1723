"""Reads: which domain events become which notices, who listens, the delivery log, the alerts.

A *notice* is one thing to tell (one Slack ``Event`` with its payload and an idempotency key);
a delivery is a notice for one channel. Domain events are translated here, in one table
(``TRANSLATORS``), so an event nobody translates is ignored, and the key of a notice does not
depend on who announced it: the lifecycle tick's ``reservation.starting_soon`` and our own
reminder sweep name the same reminder with the same key, so it is sent once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import DateTimeField, Exists, F, Func, OuterRef, Q
from django.utils import timezone

from portal.core.actors import STAFF_WORDS, actor_name
from portal.core.models import AuditLog
from portal.core.redact import without_processes, without_secrets
from portal.core.timefmt import format_utc
from portal.core.words import count_of
from reservations.choices import HOLDING_STATUSES, AllocationKind
from reservations.models import Allocation, Node, Reservation
from tenants.choices import Role
from tenants.models import Tenant

from .choices import PLATFORM_DEFAULT_EVENTS, TERMINAL_STATUSES, ChannelKind, DeliveryStatus
from .models import Channel, Delivery, QuotaAlertState, url_fingerprint
from .slack import Event

__all__ = [
    "Notice",
    "TRANSLATORS",
    "handles",
    "notices_for",
    "channels_for_notice",
    "anyone_listening",
    "platform_url",
    "jsonable",
    "as_id",
    "actor_words",
    "reservation_payload",
    "reminders_due",
    "reminder_obsolete",
    "quota_alert_obsolete",
    "deliveries_for_user",
    "channels_for_user",
    "latest_tests",
    "broken_channels_for_user",
    "failed_deliveries_count",
    "lead_tenants",
    "stuck_delivery_ids",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Notice:
    """One thing to tell: a Slack event name, its payload, and the key that makes it unique."""

    event: str
    key: str
    payload: dict[str, Any]
    source_event: str
    tenant_id: int | None = None
    to_tenant: bool = True
    to_platform: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def jsonable(payload: dict[str, Any]) -> dict[str, Any]:
    """Return payload as plain JSON types (datetimes become ISO strings), as Celery will carry it."""
    return json.loads(json.dumps(payload, cls=DjangoJSONEncoder))


def without_secrets_in(payload: dict[str, Any]) -> dict[str, Any]:
    """payload with its error texts (a reason, a check's failures: a backend's or a tool's output) passed through
    portal.core.redact.without_secrets, for every channel: Slack and webhooks are no place for a credential (the
    log and the admin keep the texts whole)."""
    return _error_texts_through(payload, without_secrets)


def _error_texts_through(data: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """data with its error texts (the reason, a check's failures) passed through fn."""
    told = dict(data)
    if isinstance(told.get("reason"), str):
        told["reason"] = fn(told["reason"])
    if isinstance(told.get("failures"), list):
        told["failures"] = [fn(str(f)) for f in told["failures"]]
    return told


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(jsonable(payload), sort_keys=True).encode()).hexdigest()[:16]


def platform_url() -> str:
    return getattr(settings, "PORTAL_PLATFORM_SLACK_WEBHOOK", "") or ""


# --- payloads ---------------------------------------------------------------------------


def as_id(value: Any) -> int | None:
    """Return value as a primary key, or None for anything that is not a whole number."""
    if isinstance(value, bool):
        return None
    try:
        pk = int(value)
    except (TypeError, ValueError):
        return None
    return pk if 0 < pk < 2**63 else None


def _reservation(reservation_id: Any) -> Reservation | None:
    pk = as_id(reservation_id)
    if pk is None:
        return None
    return Reservation.objects.select_related("tenant", "pool", "created_by").filter(pk=pk).first()


def _last_audit(reservation: Reservation, actions: Iterable[str]) -> AuditLog | None:
    return (
        AuditLog.objects.select_related("actor")
        .filter(object_type="reservations.reservation", object_id=str(reservation.pk), action__in=list(actions))
        .order_by("-id")
        .first()
    )


def actor_words(user: Any) -> str | None:
    """Who acted, as a tenant's channel is told: a teammate's username, "platform staff" for a staff account
    (portal.core.actors; the audit rows keep the account)."""
    return actor_name(user, viewer=None, staff=STAFF_WORDS)


def reservation_payload(reservation: Reservation, *, actor: str | None = None) -> dict[str, Any]:
    """Return what the Slack builders and webhook receivers get about one reservation."""
    allocations = Allocation.objects.filter(reservation=reservation, kind=AllocationKind.RESERVATION)
    active = sorted(set(allocations.filter(active=True).values_list("node__hostname", flat=True)))
    nodes = active or sorted(set(allocations.values_list("node__hostname", flat=True)))
    payload: dict[str, Any] = {
        "tenant": reservation.tenant.slug,
        "tenant_name": reservation.tenant.name,
        "reservation_id": reservation.pk,
        "name": reservation.name,
        "pool": reservation.pool.name,
        "node_count": reservation.node_count,
        "start": format_utc(reservation.period.lower),
        "end": format_utc(reservation.period.upper),
        "billing": reservation.billing,
        "status": reservation.status,
        "orchestrator": reservation.orchestrator,
        "cuda_version": reservation.cuda_version,
        "nodes": nodes,
    }
    if actor is None and reservation.created_by is not None:
        actor = actor_words(reservation.created_by)
    if actor:
        payload["actor"] = actor
    return payload


# --- translators: domain event -> notices -------------------------------------------------

Translator = Callable[[str, dict[str, Any]], list[Notice]]

# Audit actions that change a reservation and announce reservation.changed: the newest one names the change.
CHANGE_ACTIONS = ("reservation.update", "reservation.node_replaced", "reservation.replace_node")
# What an audit snapshot of a reservation says about it at that moment (reservations.services._snapshot).
SNAPSHOT_KEYS = frozenset({"start", "end", "node_count", "status", "billing", "name"})
# The lifecycle tick's reminders (reservation.starting_soon / ending_soon, sent
# PORTAL_REMIND_BEFORE_*_MINUTES ahead) name only the boundary. Each is told as the Slack reminder
# whose "in about 1 hour" / "in about 24 hours" is true at that moment: within these bounds of
# the boundary. Further out, or in between, it is left to reminders_due's own on-time reminder
# (same key, so nothing is sent twice) rather than told with a lead time that is false.
REMINDER_ABOUT = {1: (timedelta(0), timedelta(minutes=75)), 24: (timedelta(hours=22), timedelta(hours=25))}


def _reminder_hours(left: timedelta) -> int | None:
    return next((hours for hours, (low, high) in REMINDER_ABOUT.items() if low < left <= high), None)


def _reservation_notice(slack_event: str, *, key_suffix: str = "") -> Translator:
    def translate(name: str, payload: dict[str, Any]) -> list[Notice]:
        reservation = _reservation(payload.get("reservation_id"))
        if reservation is None:
            return []
        data = reservation_payload(reservation)
        key = f"{slack_event}:r{reservation.pk}{key_suffix}"
        # The audit row of the change holds the reservation as it was right then; a fan-out running
        # after a later change (or a cancel) still tells this event's story, not the latest state.
        snapshot_action = {Event.RESERVATION_CONFIRMED: "reservation.create",
                           Event.RESERVATION_CANCELLED: "reservation.cancel"}.get(slack_event)
        if snapshot_action:
            audit = _last_audit(reservation, [snapshot_action])
            if audit is not None:
                data.update({k: v for k, v in (audit.after or {}).items() if k in SNAPSHOT_KEYS})
        if slack_event == Event.RESERVATION_CHANGED:
            # One message per change: the audit row of the change names it. Two changes fanned
            # out late both find the newest row and coalesce into one message with the latest state.
            audit = _last_audit(reservation, CHANGE_ACTIONS)
            if audit is not None:
                key += f":a{audit.pk}"
                if audit.actor is not None:
                    data["actor"] = actor_words(audit.actor)
                before = (audit.before or {}) if audit.action == "reservation.update" else {}
                if audit.action == "reservation.update":
                    data.update({k: v for k, v in (audit.after or {}).items() if k in SNAPSHOT_KEYS})
                for src, dst in (("start", "previous_start"), ("end", "previous_end"),
                                 ("node_count", "previous_node_count")):
                    if before.get(src) is not None:
                        data[dst] = before[src]
            else:
                key += f":u{reservation.updated_at.timestamp():.6f}"
        elif slack_event == Event.RESERVATION_CANCELLED:
            audit = _last_audit(reservation, ["reservation.cancel"])
            if audit is not None and audit.actor is not None:
                data["actor"] = actor_words(audit.actor)
        return [Notice(event=slack_event, key=key, payload=data, source_event=name, tenant_id=reservation.tenant_id)]

    return translate


def _boundary_moved_at(reservation: Reservation, kind: str) -> datetime | None:
    """When the reservation's start (kind "starting") or end was last moved; None if never.

    (A booking made after a reminder's moment is left out where reminders are found: reminders_due
    and the lifecycle tick compare created_at.)
    """
    field_name = "start" if kind == "starting" else "end"
    changes = (
        AuditLog.objects.filter(object_type="reservations.reservation", object_id=str(reservation.pk),
                                action="reservation.update")
        .order_by("-id").values_list("created_at", "before", "after")
    )
    for created_at, before, after in changes:
        if (before or {}).get(field_name) != (after or {}).get(field_name):
            return created_at
    return None


def _reminder(kind: str) -> Translator:
    """reservation.starting_soon / ending_soon with ``hours``: keyed by the reservation's boundary."""

    def translate(name: str, payload: dict[str, Any]) -> list[Notice]:
        reservation = _reservation(payload.get("reservation_id"))
        if reservation is None or reservation.status not in HOLDING_STATUSES:
            return []
        boundary = reservation.period.lower if kind == "starting" else reservation.period.upper
        left = boundary - timezone.now()
        if left <= timedelta(0):
            return []  # announced too late to be true
        hours = payload.get("hours")
        if hours is None:
            # The lifecycle tick says only which boundary (start=/end=); how far off it is decides.
            hours = _reminder_hours(left)
        if kind == "starting":
            slack_event = Event.RESERVATION_STARTING_1H if hours == 1 else None
        else:
            slack_event = {24: Event.RESERVATION_ENDING_24H, 1: Event.RESERVATION_ENDING_1H}.get(as_id(hours) or 0)
        if slack_event is None:
            return []
        lead = timedelta(hours=24) if slack_event == Event.RESERVATION_ENDING_24H else timedelta(hours=1)
        moved_at = _boundary_moved_at(reservation, kind)
        if moved_at is not None and moved_at > boundary - lead:
            # Moved there after this reminder's moment (extended 3 h before the end): "ends in about
            # 24 hours" would be false, and the change was announced anyway — as for a late booking.
            return []
        key = f"{slack_event}:r{reservation.pk}:{format_utc(boundary)}"
        return [Notice(event=slack_event, key=key, payload=reservation_payload(reservation), source_event=name,
                       tenant_id=reservation.tenant_id)]

    return translate


def _cluster_lookup(payload: dict[str, Any]) -> tuple[Reservation | None, dict[str, Any]]:
    """Find the reservation behind a cluster event (by reservation_id, else via the cluster)."""
    extra: dict[str, Any] = {}
    reservation = _reservation(payload.get("reservation_id"))
    cluster_id = payload.get("cluster_id")
    if cluster_id is not None:
        extra["cluster_id"] = cluster_id
    if reservation is None and cluster_id is not None:
        VirtualCluster = _optional_model("provisioning", "VirtualCluster")
        if VirtualCluster is not None:
            cluster = VirtualCluster.objects.filter(pk=as_id(cluster_id) or 0).values("reservation_id").first()
            if cluster:
                reservation = _reservation(cluster["reservation_id"])
    return reservation, extra


_CLUSTER_KEYS = ("phase", "reason", "access", "orchestrator", "cuda_version", "recovered")


def _optional_model(app_label: str, name: str):
    """A model of an app above us in the stack that may not be installed (looked up, never imported)."""
    try:
        return apps.get_model(app_label, name)
    except LookupError:
        return None


def _transition_ident(cluster_id: Any, payload: dict[str, Any]) -> str:
    """Name one cluster transition: the row the event names, else the newest of its phase, else the payload."""
    named = as_id(payload.get("transition_id"))
    if named is not None:
        return f"t{named}"
    ClusterTransition = _optional_model("provisioning", "ClusterTransition")
    status = payload.get("status")
    pk = as_id(cluster_id)
    if ClusterTransition is not None and pk is not None and status:
        row = ClusterTransition.objects.filter(cluster_id=pk, phase=status).order_by("-pk").values("pk").first()
        if row:
            return f"t{row['pk']}"
    return _digest(payload)


def _cluster_connection(cluster_id: Any) -> dict[str, Any]:
    """The cluster's connection details (login host, account, namespace …: nothing secret), or {}."""
    VirtualCluster = _optional_model("provisioning", "VirtualCluster")
    pk = as_id(cluster_id)
    if VirtualCluster is None or pk is None:
        return {}
    connection = VirtualCluster.objects.filter(pk=pk).values_list("connection", flat=True).first()
    return dict(connection) if isinstance(connection, dict) else {}


def _access_text(connection: dict[str, Any]) -> str:
    """How to connect, one line each: the ssh command when there is a login host, then every detail."""
    lines = []
    if connection.get("login_host") and connection.get("ssh_user"):
        lines.append(f"ssh {connection['ssh_user']}@{connection['login_host']}")
    lines += [f"{key}: {value}" for key, value in connection.items()]
    return "\n".join(lines)


def _cluster_notice(slack_event: str) -> Translator:
    def translate(name: str, payload: dict[str, Any]) -> list[Notice]:
        reservation, extra = _cluster_lookup(payload)
        if reservation is None:
            return []
        data = {**reservation_payload(reservation), **extra}
        for key in _CLUSTER_KEYS:
            if payload.get(key) not in (None, ""):
                data[key] = payload[key]
        if slack_event == Event.CLUSTER_READY and "access" not in data and not data.get("recovered"):
            # Ready means "go ahead": say how (the cluster's non-secret connection details; the
            # credentials themselves are only on the cluster page the message links to).
            connection = _cluster_connection(extra.get("cluster_id"))
            if connection:
                data["connection"] = connection
                data["access"] = _access_text(connection)
        if slack_event == Event.CLUSTER_DEGRADED and (payload.get("nodes") or payload.get("node")):
            data["nodes"] = list(payload.get("nodes") or [payload["node"]])
        elif slack_event == Event.CLUSTER_DEGRADED:
            # Degraded for no one node (a window change its backend refused): the reason says why; the
            # booking's nodes are not "affected nodes".
            data.pop("nodes", None)
        if slack_event == Event.CLUSTER_DEGRADED and payload.get("node"):
            # The same node failure may also arrive as reservation.degraded: one message for both.
            key = _node_failure_key(reservation.pk, payload)
        else:
            key = f"{slack_event}:r{reservation.pk}:{_transition_ident(extra.get('cluster_id'), payload)}"
        return [Notice(event=slack_event, key=key, payload=data, source_event=name, tenant_id=reservation.tenant_id)]

    return translate


def _credentials_renewed(name: str, payload: dict[str, Any]) -> list[Notice]:
    """A live cluster's kubeconfig was issued again: the team's downloaded one stops working (provisioning)."""
    reservation, extra = _cluster_lookup(payload)
    if reservation is None or "cluster_id" not in extra:
        return []
    data = {**reservation_payload(reservation), **extra}
    for key in ("expires_at", "previous_expires_at"):
        try:
            data[key] = format_utc(datetime.fromisoformat(str(payload[key])))
        except (KeyError, TypeError, ValueError):
            pass  # no expiry known (an API server that says none), or an unreadable one: left out
    # One message per kubeconfig issued: the new token's issue time names it (a redelivered event adds nothing).
    ident = payload.get("issued_at") or _digest(payload)
    key = f"{Event.CLUSTER_CREDENTIALS_RENEWED}:r{reservation.pk}:c{extra['cluster_id']}:{ident}"
    return [Notice(event=Event.CLUSTER_CREDENTIALS_RENEWED, key=key, payload=data, source_event=name,
                   tenant_id=reservation.tenant_id)]


def _node_failure_key(reservation_id: int, payload: dict[str, Any]) -> str:
    """Name one failure of a node in a booking: by the booking's allocation the node lost, which
    reservation.degraded and the cluster.degraded it causes both carry (one message for the two, and a
    redelivered event adds nothing). The same node failing again in the booking (it came back as a spare)
    lost another allocation: another message. Events from before they carried it: by the node alone."""
    key = f"{Event.CLUSTER_DEGRADED}:r{reservation_id}:{payload['node']}"
    allocation = as_id(payload.get("allocation_id"))
    return f"{key}:a{allocation}" if allocation is not None else key


def _reservation_degraded(name: str, payload: dict[str, Any]) -> list[Notice]:
    """A failed node with no spare left: the tenant's cluster runs short (reservations.node_replace_allocations)."""
    reservation = _reservation(payload.get("reservation_id"))
    if reservation is None:
        return []
    data = reservation_payload(reservation)
    if payload.get("node"):
        data["nodes"] = [payload["node"]]
    missing = payload.get("missing_nodes")
    reason = str(payload.get("reason") or "")
    if missing:
        reason = f"{count_of(missing, 'node')} missing. {reason}".strip()
    if reason:
        data["reason"] = reason
    key = _node_failure_key(reservation.pk, payload) if payload.get("node") else \
        f"{Event.CLUSTER_DEGRADED}:r{reservation.pk}:m{missing}"
    return _told_apart(Notice(event=Event.CLUSTER_DEGRADED, key=key, payload=data, source_event=name,
                              tenant_id=reservation.tenant_id))


def _node_replaced(name: str, payload: dict[str, Any]) -> list[Notice]:
    reservation = _reservation(payload.get("reservation_id"))
    failed = payload.get("failed") or payload.get("node")
    spare = payload.get("spare") or payload.get("replacement")
    if reservation is None or not failed or not spare:
        return []
    data = {**reservation_payload(reservation), "node": failed, "replacement": spare}
    if payload.get("reason"):
        data["reason"] = str(payload["reason"])
    if payload.get("cluster_id") is not None:
        data["cluster_id"] = payload["cluster_id"]
    key = f"{Event.NODE_REPLACED}:r{reservation.pk}:{failed}:{spare}"
    allocation = as_id(payload.get("allocation_id"))
    if allocation is not None:  # the allocation the node lost names this swap (the same pair may swap again)
        key = f"{key}:a{allocation}"
    return _told_apart(Notice(event=Event.NODE_REPLACED, key=key, payload=data, source_event=name,
                              tenant_id=reservation.tenant_id))


def _told_apart(notice: Notice) -> list[Notice]:
    """notice for the tenant's channels and the platform's: one, or two when the teams hear less than staff
    (its reason names processes: a failed check's summary as an older agent stored it)."""
    told = _as_told_to_tenants(notice.payload)
    if told == notice.payload:
        return [notice]
    return [replace(notice, payload=told, to_platform=False), replace(notice, to_tenant=False)]


def _node(payload: dict[str, Any]) -> Node | None:
    if payload.get("node_id") is not None:
        pk = as_id(payload["node_id"])
        return None if pk is None else Node.objects.select_related("pool").filter(pk=pk).first()
    hostname = payload.get("node") or payload.get("hostname")
    if hostname:
        return Node.objects.select_related("pool").filter(hostname=str(hostname)).first()
    return None


def _running_reservations(node: Node) -> list[Reservation]:
    """The reservations holding node right now (the tenants a node failure hits)."""
    now = timezone.now()
    return list(
        Reservation.objects.select_related("tenant", "pool", "created_by")
        .filter(
            status__in=HOLDING_STATUSES,
            allocations__node=node, allocations__active=True, allocations__period__contains=now,
        )
        .distinct()
    )


def _as_told_to_tenants(data: dict[str, Any]) -> dict[str, Any]:
    """data as the teams hear it: the reason and a check's failures name no process (another team's work:
    portal.core.redact); staff hear it all."""
    return _error_texts_through(data, without_processes)


def _node_notices(slack_event: str, name: str, payload: dict[str, Any], node: Node, *, key: str,
                  extra: dict[str, Any]) -> list[Notice]:
    """One notice per tenant running on the node (tenant channels), one for the platform channel."""
    notices = []
    holders = _running_reservations(node)
    base = {"node": node.hostname, "pool": node.pool.name, **extra}
    if node.state_reason and "reason" not in base:
        base["reason"] = node.state_reason
    told = _as_told_to_tenants(base)
    for reservation in holders:
        data = {**reservation_payload(reservation), **told}
        data.pop("nodes", None)
        notices.append(Notice(event=slack_event, key=f"{key}:r{reservation.pk}", payload=data, source_event=name,
                              tenant_id=reservation.tenant_id, to_platform=False))
    # The health checks name the tenants they took the node from (its bookings may have moved already).
    holding = {r.tenant_id for r in holders}
    named = [pk for pk in (as_id(t) for t in payload.get("tenant_ids") or []) if pk is not None and pk not in holding]
    others = list(Tenant.objects.filter(pk__in=named))
    for tenant in others:
        notices.append(Notice(event=slack_event, key=f"{key}:t{tenant.pk}", source_event=name, tenant_id=tenant.pk,
                              payload={"tenant": tenant.slug, "tenant_name": tenant.name, **told}, to_platform=False))
    tenants = ", ".join(sorted({r.tenant.slug for r in holders} | {t.slug for t in others})) or "no tenant"
    notices.append(Notice(event=slack_event, key=key, payload={"tenant": tenants, **base}, source_event=name,
                          tenant_id=None, to_tenant=False))
    return notices


# How long after a repair ends as failed its node's row may change and still be that same failure (the
# node follows in the next transaction; a reconcile after a dead worker, within minutes).
_REPAIR_CLOSE_SLACK = timedelta(minutes=30)


def _failure_ident(node: Node, payload: dict[str, Any]) -> str:
    """Name one failure of a node: its repair when the health checks opened one, else the node's row version.

    node.failed (health checks) and node.state_changed to failed (any path) then name a
    failure alike, so it is announced once.
    """
    repair_id = as_id(payload.get("repair_id"))
    if repair_id is None:
        Repair = _optional_model("health", "Repair")
        if Repair is not None:
            # The repair this failure belongs to: one still open, or one that has just ended as failed (it
            # put the node in that state moments before the node's row changed). A repair closed long
            # before — the node came back, then failed again — is another failure, announced anew.
            repair_id = (
                Repair.objects.filter(node_id=node.pk)
                .filter(Q(closed_at__isnull=True)
                        | Q(state="failed", closed_at__gte=node.updated_at - _REPAIR_CLOSE_SLACK))
                .order_by("-pk").values_list("pk", flat=True).first()
            )
    return f"repair{repair_id}" if repair_id is not None else f"u{node.updated_at.timestamp():.0f}"


def _node_failed(name: str, payload: dict[str, Any]) -> list[Notice]:
    """node.failed, or node.state_changed to failed: the same failure, named by the node's row version."""
    if name == "node.state_changed" and payload.get("new") != "failed":
        return []
    node = _node(payload)
    if node is None:
        return []
    key = f"{Event.NODE_FAILED}:n{node.pk}:{_failure_ident(node, payload)}"
    extra = {"reason": str(payload["reason"])} if payload.get("reason") else {}
    return _node_notices(Event.NODE_FAILED, name, payload, node, key=key, extra=extra)


_HEALTH_KEYS = ("level", "verdict", "failures", "reason", "cluster_id")


def _problem_text(problem: Any) -> str:
    """One line per problem the health checks report ({gpu, check, status, action, message})."""
    if not isinstance(problem, dict):
        return str(problem)
    where = f"GPU {problem['gpu']}: " if problem.get("gpu") is not None else ""
    what = " ".join(str(problem[k]) for k in ("check", "status") if problem.get(k))
    text = f"{where}{what}"
    if problem.get("message"):
        text += f" — {problem['message']}"
    if problem.get("action"):
        text += f" ({problem['action']})"
    return text or "failed"


def _health_check_failed(name: str, payload: dict[str, Any]) -> list[Notice]:
    if payload.get("verdict") in ("pass", "warn"):
        return []
    node = _node(payload)
    if node is None:
        return []
    extra = {k: payload[k] for k in _HEALTH_KEYS if payload.get(k) not in (None, "")}
    if "failures" in extra:
        extra["failures"] = [str(f) for f in extra["failures"]][:100]
    elif payload.get("problems"):
        extra["failures"] = [_problem_text(p) for p in payload["problems"]][:100]
    ident = payload.get("health_check_id") or payload.get("check_id") or payload.get("id") or _digest(payload)
    key = f"{Event.HEALTH_CHECK_FAILED}:n{node.pk}:{ident}"
    reservation = _reservation(payload.get("reservation_id"))
    if reservation is not None:
        data = {**reservation_payload(reservation), "node": node.hostname, **_as_told_to_tenants(extra)}
        data.pop("nodes", None)
        return [
            Notice(event=Event.HEALTH_CHECK_FAILED, key=f"{key}:r{reservation.pk}", payload=data, source_event=name,
                   tenant_id=reservation.tenant_id, to_platform=False),
            Notice(event=Event.HEALTH_CHECK_FAILED, key=key,
                   payload={"tenant": reservation.tenant.slug, "node": node.hostname, "pool": node.pool.name,
                            **extra},
                   source_event=name, tenant_id=None, to_tenant=False),
        ]
    return _node_notices(Event.HEALTH_CHECK_FAILED, name, payload, node, key=key, extra=extra)


TRANSLATORS: dict[str, Translator] = {
    "reservation.confirmed": _reservation_notice(Event.RESERVATION_CONFIRMED),
    "reservation.changed": _reservation_notice(Event.RESERVATION_CHANGED),
    "reservation.cancelled": _reservation_notice(Event.RESERVATION_CANCELLED),
    "reservation.starting_soon": _reminder("starting"),
    "reservation.ending_soon": _reminder("ending"),
    "reservation.degraded": _reservation_degraded,
    "cluster.ready": _cluster_notice(Event.CLUSTER_READY),
    "cluster.failed": _cluster_notice(Event.CLUSTER_FAILED),
    "cluster.degraded": _cluster_notice(Event.CLUSTER_DEGRADED),
    "cluster.credentials_renewed": _credentials_renewed,
    "node.failed": _node_failed,
    "node.state_changed": _node_failed,
    "node.replaced": _node_replaced,
    "health_check.failed": _health_check_failed,
    "health.check_failed": _health_check_failed,
}
# Booking changes move the tenant's usage: re-check the quota alert for that pool.
QUOTA_EVENTS = frozenset({"reservation.confirmed", "reservation.changed", "reservation.cancelled"})


def handles(event: str) -> bool:
    return event in TRANSLATORS


def notices_for(event: str, payload: dict[str, Any]) -> list[Notice]:
    """Translate a domain event into notices; an unknown event or a vanished object gives []."""
    translate = TRANSLATORS.get(event)
    if translate is None:
        return []
    return translate(event, payload)


# --- who listens ----------------------------------------------------------------------------


def _tenants_listening():
    """Tenants with an enabled channel or a Slack URL (whose channel row is made on first use)."""
    return Tenant.objects.filter(
        Q(Exists(Channel.objects.filter(tenant=OuterRef("pk"), enabled=True))) | ~Q(slack_webhook_url="")
    )


def anyone_listening(event: str, payload: dict[str, Any]) -> bool:
    """Cheap check (one query) before queueing a fan-out: could any channel want this event at all?"""
    if platform_url():
        return True
    tenants = _tenants_listening()
    tenant_id = as_id(payload.get("tenant_id"))
    if tenant_id is not None:
        tenants = tenants.filter(pk=tenant_id)
    # Fleet events name no tenant (or several): any listening tenant might be affected.
    return tenants.exists()


def channels_for_notice(notice: Notice, *, platform: Channel | None) -> list[Channel]:
    """The enabled channels subscribed to the notice's event, among its tenant's and the platform's."""
    found: list[Channel] = []
    if notice.to_tenant and notice.tenant_id is not None:
        for channel in Channel.objects.select_related("tenant").filter(
            tenant_id=notice.tenant_id, enabled=True, events__contains=[notice.event]
        ):
            if channel.target_url():
                found.append(channel)
    if notice.to_platform and platform is not None and platform.enabled and notice.event in platform.events:
        found.append(platform)
    return found


def platform_default_events() -> list[str]:
    configured = getattr(settings, "PORTAL_PLATFORM_SLACK_EVENTS", None)
    events = configured or PLATFORM_DEFAULT_EVENTS
    return [str(e) for e in events]


# --- reminders ------------------------------------------------------------------------------


def _platform_hears_reminders() -> bool:
    """Whether the platform channel (set up, enabled) is subscribed to a reminder: then every tenant's count."""
    if not platform_url():
        return False
    row = Channel.objects.filter(tenant__isnull=True, kind=ChannelKind.SLACK).values("enabled", "events").first()
    enabled, events = (row["enabled"], row["events"]) if row else (True, platform_default_events())
    return enabled and any(str(e) in events for e in REMINDER_BOUNDARY)


def reminders_due(*, now: datetime) -> list[tuple[str, int, int]]:
    """Return (domain event, reservation id, hours) for every reminder whose moment has come.

    "Starts in 1 h" goes out in the hour before the start, "ends in 24 h" between 24 h and 1 h
    before the end (only for reservations at least a day long), "ends in 1 h" in the last hour.
    A reminder is never sent for a booking made after its moment (a booking made 30 minutes
    ahead does not need "starts in 1 h"). The delivery key makes repeats harmless.
    """
    hour, day = timedelta(hours=1), timedelta(hours=24)
    lower = Func(F("period"), function="lower", output_field=DateTimeField())
    upper = Func(F("period"), function="upper", output_field=DateTimeField())
    base = Reservation.objects.filter(status__in=HOLDING_STATUSES)
    if not _platform_hears_reminders():
        base = base.filter(tenant__in=_tenants_listening())
    base = base.annotate(start=lower, end=upper)
    due: list[tuple[str, int, int]] = []
    for pk in base.filter(start__gt=now, start__lte=now + hour, created_at__lte=F("start") - hour).values_list(
        "pk", flat=True
    ):
        due.append(("reservation.starting_soon", pk, 1))
    for pk in base.filter(
        end__gt=now + hour, end__lte=now + day, start__lte=F("end") - day, created_at__lte=F("end") - day
    ).values_list("pk", flat=True):
        due.append(("reservation.ending_soon", pk, 24))
    for pk in base.filter(
        end__gt=now, end__lte=now + hour, start__lte=F("end") - hour, created_at__lte=F("end") - hour
    ).values_list("pk", flat=True):
        due.append(("reservation.ending_soon", pk, 1))
    return due


# Which boundary each reminder is about (the payload names it as format_utc gives it).
REMINDER_BOUNDARY = {
    Event.RESERVATION_STARTING_1H: "start",
    Event.RESERVATION_ENDING_24H: "end",
    Event.RESERVATION_ENDING_1H: "end",
}


def reminder_obsolete(delivery: Delivery, *, now: datetime) -> str:
    """Why a reminder must no longer be sent ('' if it still holds, or is no reminder).

    A reminder can wait for its send (retries while the receiver is down, a long queue) while the
    booking is cancelled, moved or has reached the boundary: it would then tell something false.
    """
    field_name = REMINDER_BOUNDARY.get(delivery.event)
    if field_name is None:
        return ""
    reservation = Reservation.objects.filter(pk=as_id((delivery.payload or {}).get("reservation_id")) or 0).first()
    if reservation is None:
        return "reservation_deleted"
    if reservation.status not in HOLDING_STATUSES:
        return f"reservation_{reservation.status}"
    boundary = reservation.period.lower if field_name == "start" else reservation.period.upper
    if format_utc(boundary) != delivery.payload.get(field_name):
        return f"reservation_moved: the {field_name} is now {format_utc(boundary)}"
    if boundary <= now:
        return f"reservation_{field_name}_passed"
    return ""


_QUOTA_ALERT_KEY = re.compile(rf"^{re.escape(str(Event.QUOTA_THRESHOLD))}:q(\d+):n(\d+)\|")


def quota_alert_obsolete(delivery: Delivery) -> str:
    """Why a quota alert must no longer be sent ('' if it still holds, or is no quota alert).

    An alert tells of one upward crossing (its key names the quota and the crossing's number).
    Waiting for its send while the tenant's use fell back below the threshold (a booking
    cancelled, shortened), it would tell something false; a later crossing has its own alert.
    """
    if delivery.event != Event.QUOTA_THRESHOLD:
        return ""
    match = _QUOTA_ALERT_KEY.match(delivery.key)
    if match is None:
        return ""
    state = QuotaAlertState.objects.filter(quota_id=int(match[1])).values("above", "crossings", "last_peak").first()
    if state is None:
        return "quota_deleted"
    if not state["above"] or state["crossings"] != int(match[2]):
        return f"quota_below_threshold: {count_of(state['last_peak'], 'node')} booked at the last check"
    return ""


# --- the log, the settings page and the alerts ------------------------------------------------


def lead_tenants(*, user):
    """Tenants whose notifications user may see and manage: leads their own, staff all."""
    return Tenant.objects.for_user(user) if user.is_staff else Tenant.objects.for_user(user, roles=[Role.LEAD])


def deliveries_for_user(*, user, tenant: Tenant | None = None, status: str | None = None):
    """The delivery log: a lead sees their tenants' deliveries, staff everything (platform too)."""
    qs = Delivery.objects.for_user(user) if user.is_staff else Delivery.objects.for_user(user, roles=[Role.LEAD])
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if status:
        qs = qs.filter(status=status)
    return qs.select_related("tenant", "channel")


def channels_for_user(*, user, tenant: Tenant):
    qs = Channel.objects.for_user(user) if user.is_staff else Channel.objects.for_user(user, roles=[Role.LEAD])
    return qs.filter(tenant=tenant).select_related("tenant")


def latest_tests(channels) -> dict[int, Delivery]:
    """The newest test message of each of these channels, by channel id (what "Send test message" came to)."""
    ids = [channel.pk for channel in channels]
    if not ids:
        return {}
    rows = (Delivery.objects.filter(channel_id__in=ids, event=Event.TEST)
            .order_by("channel_id", "-created_at", "-id").distinct("channel_id"))
    return {delivery.channel_id: delivery for delivery in rows}


def broken_channels_for_user(*, user, tenant: Tenant | None = None) -> list[Channel]:
    """Channels a lead must fix (and, for staff, the platform channel): broken on their current URL."""
    if not getattr(user, "is_authenticated", False):
        return []
    scoped = Channel.objects.filter(broken_at__isnull=False).select_related("tenant")
    if user.is_staff:
        if tenant is not None:
            scoped = scoped.filter(Q(tenant=tenant) | Q(tenant__isnull=True))
    else:
        scoped = scoped.filter(tenant__in=Tenant.objects.for_user(user, roles=[Role.LEAD]))
        if tenant is not None:
            scoped = scoped.filter(tenant=tenant)
    return [c for c in scoped if c.broken_url_fp == url_fingerprint(c.target_url())]


def failed_deliveries_count(*, user, tenant: Tenant | None = None, days: int = 7) -> int:
    since = timezone.now() - timedelta(days=days)
    return deliveries_for_user(user=user, tenant=tenant, status=DeliveryStatus.FAILED).filter(
        created_at__gte=since
    ).count()


def stuck_delivery_ids(*, now: datetime, grace: timedelta, limit: int = 500) -> list[int]:
    """Deliveries a worker should be busy with but apparently is not (lost message, killed worker)."""
    late = now - grace
    return list(
        Delivery.objects.exclude(status__in=TERMINAL_STATUSES)
        .filter(
            Q(status__in=[DeliveryStatus.PENDING, DeliveryStatus.RETRYING], next_attempt_at__lte=late)
            | Q(status=DeliveryStatus.PENDING, next_attempt_at__isnull=True, created_at__lte=late)
            | Q(status=DeliveryStatus.SENDING, lease_until__lte=late)
        )
        .order_by("id")
        .values_list("id", flat=True)[:limit]
    )
