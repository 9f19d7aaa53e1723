"""Health-check writes: queue checks, send them to agents, record reports, drain, repair, accept.

How the pieces fit (DESIGN §3, §5):

- :func:`health_checks_request` inserts one ``queued`` row per node (``INSERT … ON CONFLICT DO
  NOTHING``: an open check of the same node, level and booking is reused, never doubled) and,
  after commit, :func:`dispatch` sends each to its agent: real nodes on their own Celery queue
  ``node.<hostname>`` (``PORTAL_HEALTH_AGENT_QUEUE=node``), the simulated fleet in batches on
  the one ``fleet`` queue (the default; one worker cannot poll 10,000 queues).
- The agent runs the level and posts the report back by id; :func:`health_checks_record`
  stores many reports in one statement and applies what a verdict means
  (:func:`health_check_handle`): a ``fail`` drains an in-service node, opens a :class:`Repair`
  and moves its running and future bookings to spares (``node_replace_allocations``, under the
  exclusion constraint) or degrades the reservation. A check's consequences are applied once
  (``handled_at``); the beat's :func:`health_maintain` finishes any a crashed worker left.
- Repairs: recommended → accepted → cordoned → remediating → retesting (a medium check) →
  rejoined, or failed; each step by staff, audited, announced. A failing re-test sends the
  repair back to remediating.
- :func:`acceptance_verdict` / :func:`health_acceptance_gate`: a cluster is handed over only
  when its nodes pass a medium check.

Events (after commit): ``health_check.failed`` (check_id, node_id, node, level, trigger, verdict,
recommended_action, problems, tenant_ids, reservation_id), ``node.failed`` (node_id, node, state,
reason, check_id, repair_id, recommended_action, tenant_ids, outcomes), ``repair.changed``
(repair_id, node_id, node, state, previous, actor, note).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Exists, Max, Min, OuterRef, Q, Subquery
from django.utils import timezone

from portal.core import events
from portal.core.broker import queue_lengths
from portal.core.exceptions import Busy, InvalidInput, InvalidState, PermissionDenied
from portal.core.models import AuditLog
from portal.core.redact import without_processes
from portal.core.services import audit_record
from portal.core.words import count_of
from reservations.choices import HOLDING_STATUSES, AllocationKind, NodeState, ReservationStatus
from reservations.models import Allocation, Node, Reservation
from reservations.services import node_replace_allocations, node_update
from tenants.choices import BOOKING_ROLES
from tenants.models import Membership

from ..constants import LOCK_NODE_HEALTH
from ..selectors import failed_teardown_hold, nodes_held_after_failed_teardown
from . import conf
from .checks import cuda_major_minor
from .choices import (
    ACCEPTABLE_VERDICTS,
    LEVEL_RANK,
    OPEN_CHECK_STATUSES,
    OPEN_REPAIR_STATES,
    REPAIR_TRANSITIONS,
    CheckLevel,
    CheckStatus,
    CheckTrigger,
    RecommendedAction,
    RepairState,
    Verdict,
)
from .models import HealthCheck, Repair
from .runner import split_report
from .selectors import booking_holds_nodes

__all__ = [
    "health_checks_request",
    "cluster_health_checks_request",
    "node_health_check_request",
    "health_sweep",
    "dispatch",
    "jobs_for",
    "health_checks_mark_running",
    "health_checks_record",
    "health_check_record",
    "health_check_handle",
    "health_checks_expire",
    "health_checks_prune",
    "health_maintain",
    "repair_open",
    "repair_advance",
    "repairs_reconcile",
    "node_return_blocker",
    "acceptance_verdict",
    "health_acceptance_gate",
]

logger = logging.getLogger(__name__)

# LOCK_NODE_HEALTH (provisioning.constants), a session advisory lock: one node's verdict consequences at a
# time (two failing checks of one node recorded together must open one repair and move its bookings once).
MAX_REPORT_BYTES = 2_000_000
MAX_EVENT_PROBLEMS = 10
IN_SERVICE_STATES = (NodeState.AVAILABLE, NodeState.DRAINING, NodeState.MAINTENANCE)


def _now() -> datetime:
    return timezone.now()


def _username(actor: Any) -> str | None:
    return actor.get_username() if getattr(actor, "pk", None) else None


@contextlib.contextmanager
def _node_lock(node_id: int) -> Iterator[None]:
    """Hold a session advisory lock on the node (spans the services' own durable transactions)."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_NODE_HEALTH, node_id])
    try:
        yield
    finally:
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_NODE_HEALTH, node_id])
        except DatabaseError:  # the connection is gone, and the lock with it
            logger.warning("could not release the health lock of node %s", node_id, exc_info=True)


def _validate_level(level: Any) -> str:
    if level not in CheckLevel.values:
        raise InvalidInput(
            f"level must be one of {', '.join(CheckLevel.values)}.",
            fields={"level": f"Choose one of {', '.join(CheckLevel.values)}."},
        )
    return str(level)


# --- queueing ---------------------------------------------------------------------------------

_INSERT_SQL = """
    INSERT INTO health_healthcheck
        (node_id, reservation_id, level, trigger, status, verdict, recommended_action, summary,
         gpu_results, report, error, agent_queue, requested_by_id, created_at)
    SELECT n.id, %(reservation)s, %(level)s, %(trigger)s, %(queued)s, '', '', '',
           '[]'::jsonb, '{}'::jsonb, '',
           CASE WHEN %(mode)s = 'node' THEN 'node.' || lower(n.hostname) ELSE %(fleet)s END,  -- conf.node_queue
           %(user)s, %(now)s
    FROM reservations_node n
    WHERE {where}
    ORDER BY n.id
    ON CONFLICT DO NOTHING
    RETURNING id
"""


def _insert_checks(
    *, where: str, params: dict[str, Any], level: str, trigger: str, reservation_id: int | None, user_id: int | None
) -> list[int]:
    values = {
        **params,
        "reservation": reservation_id,
        "level": level,
        "trigger": trigger,
        "queued": CheckStatus.QUEUED,
        "mode": conf.agent_queue_mode(),
        "fleet": conf.fleet_queue(),
        "user": user_id,
        "now": _now(),
    }
    with connection.cursor() as cur:
        cur.execute(_INSERT_SQL.replace("{where}", where), values)
        return [row[0] for row in cur.fetchall()]


# Rounds of insert-then-read in health_checks_request (see there); more are never needed in practice.
REQUEST_ROUNDS = 5


def health_checks_request(
    *,
    nodes: Iterable[Node | int],
    level: str,
    trigger: str,
    actor: Any = None,
    reservation: Reservation | None = None,
) -> list[HealthCheck]:
    """Queue a check of each node and send them to their agents after commit; return the checks.

    A node that already has an open check of this level for the same booking gets that one
    back instead of a second (the unique constraint decides, so concurrent requests agree).
    Nests inside the caller's transaction.
    """
    level = _validate_level(level)
    if trigger not in CheckTrigger.values:
        raise ValueError(f"unknown trigger {trigger!r}")
    node_ids = sorted({n.pk if isinstance(n, Node) else int(n) for n in nodes})
    if not node_ids:
        return []
    reservation_id = reservation.pk if reservation is not None else None
    with transaction.atomic():
        created: list[int] = []
        found: dict[int, HealthCheck] = {}
        # The insert skips a node with an open check; if that check finishes before the read that
        # follows (each statement sees what was committed when it began), the node is in neither.
        # It is then inserted again: a few rounds settle it, for the open check can finish only once.
        for _ in range(REQUEST_ROUNDS):
            missing = [node_id for node_id in node_ids if node_id not in found]
            if not missing:
                break
            created += _insert_checks(
                where="n.id = ANY(%(ids)s)", params={"ids": missing}, level=level, trigger=trigger,
                reservation_id=reservation_id, user_id=getattr(actor, "pk", None),
            )
            found.update((check.node_id, check) for check in HealthCheck.objects.filter(
                node_id__in=missing, level=level, reservation_id=reservation_id, status__in=OPEN_CHECK_STATUSES,
            ).select_related("node"))
        checks = list(found.values())
        if trigger in (CheckTrigger.TENANT, CheckTrigger.STAFF):
            for check in checks:
                if check.pk in created:
                    audit_record(
                        actor=actor, action="health_check.request", obj=check,
                        tenant_id=reservation.tenant_id if reservation is not None else None,
                        after={"node": check.node.hostname, "level": level, "trigger": trigger},
                    )
        if created:
            transaction.on_commit(lambda: dispatch(created))
    checks.sort(key=lambda c: c.node.hostname)
    return checks


def _membership_role(user: Any, tenant_id: int) -> str | None:
    return Membership.objects.filter(user=user, tenant_id=tenant_id).values_list("role", flat=True).first()


def cluster_health_checks_request(
    *, actor: Any, cluster: Any, level: Any, nodes: Sequence[str] | None = None
) -> list[HealthCheck]:
    """Check the nodes a live cluster holds now (leads and members of its tenant, or staff).

    The caller has already scoped the cluster to the user (another tenant's is a 404 there).
    Checks run only while the booking holds its nodes: before its start the nodes may still
    serve someone else (the acceptance gate checks them before hand-over).

    The booking's row is locked while its nodes are read and the checks queued: a cancel or a node swap
    (which lock it) in flight is waited for and seen, and one that comes later waits for the checks to be
    queued. Otherwise a check could be queued for a node the booking had just let go of — free for, or
    booked by, another tenant — and its results shown to this one.
    """
    level = _validate_level(level)
    member_role = _membership_role(actor, cluster.tenant_id)
    if member_role not in BOOKING_ROLES and not actor.is_staff:
        raise PermissionDenied("Only the tenant's leads and members can run health checks.")
    with transaction.atomic():
        reservation = Reservation.objects.select_for_update(no_key=True).get(pk=cluster.reservation_id)
        now = _now()
        if not booking_holds_nodes(reservation, now):
            raise InvalidState(
                f"Cluster #{cluster.pk}'s reservation is {reservation.status} and does not hold its nodes now; "
                "checks run on nodes the reservation holds."
            )
        held = dict(
            Allocation.objects.filter(reservation=reservation, active=True, period__contains=now)
            .values_list("node__hostname", "node_id")
        )
        if nodes:
            unknown = sorted(set(nodes) - set(held))
            if unknown:
                raise InvalidInput(
                    f"Not nodes of cluster #{cluster.pk}: {', '.join(unknown[:5])}.",
                    fields={"nodes": "Name nodes the cluster holds now."},
                )
            held = {host: held[host] for host in nodes}
        if not held:
            raise InvalidState(f"Cluster #{cluster.pk} holds no nodes right now.")
        trigger = CheckTrigger.TENANT if member_role in BOOKING_ROLES else CheckTrigger.STAFF
        return health_checks_request(
            nodes=held.values(), level=level, trigger=trigger, actor=actor, reservation=reservation
        )


def node_health_check_request(*, actor: Any, node: Node, level: Any) -> HealthCheck:
    """Queue a staff check of one node."""
    if not getattr(actor, "is_staff", False):
        raise PermissionDenied("Only platform staff can check any node.")
    return health_checks_request(nodes=[node], level=level, trigger=CheckTrigger.STAFF, actor=actor)[0]


def health_sweep(*, level: str = CheckLevel.QUICK) -> list[int]:
    """Queue a scheduled check of every node in service and send them; return the new check ids.

    One INSERT … SELECT for the whole fleet; nodes whose previous scheduled check is still
    open are skipped by the unique constraint, so a slow agent never piles up checks, and a node agent whose queue
    still holds an earlier message gets none (_dispatch_scheduled: a dead one's queue would grow). Nodes staff
    put in maintenance are checked too, but a failure there opens no repair (_staff_maintenance); staff are
    told of it (health_check.failed) once per maintenance period and failure (_staff_told).
    """
    level = _validate_level(level)
    ids = _insert_checks(
        where="n.state = ANY(%(states)s)", params={"states": list(IN_SERVICE_STATES)}, level=level,
        trigger=CheckTrigger.SCHEDULE, reservation_id=None, user_id=None,
    )
    if ids:
        transaction.on_commit(lambda: _dispatch_scheduled(ids))
    return ids


# --- dispatch ---------------------------------------------------------------------------------


def jobs_for(check_ids: Sequence[int], *, now: datetime | None = None) -> list[dict[str, Any]]:
    """Return the agent job (JSON) of each queued check, in id order.

    ``idle`` says whether the node should be idle: it is not when a holding reservation's
    window covers now (its tenant's jobs may run; stray processes are then not a fault), nor while
    a cluster whose window is over is still on the node (until the tick ends it and its teardown
    stops the tenant's jobs), nor while the node is held because that teardown failed (the cluster
    and its jobs may still be there until a retried teardown succeeds).

    ``cuda_min`` is the CUDA version the check's cluster chose (None without a cluster): the agent
    fails a node whose driver supports only older ones, and a failing gate check swaps it out. A node
    whose open repair a failing ``cuda_support`` check opened needs at least the version that failed it
    in every check (its re-test above all): otherwise the re-test, of no cluster, passes the node and it
    rejoins whether or not its driver was upgraded.
    """
    from provisioning.choices import ClusterStatus  # the cluster app may load after this one
    from provisioning.models import VirtualCluster

    now = now or _now()
    busy = Allocation.objects.filter(
        node_id=OuterRef("node_id"), active=True, kind=AllocationKind.RESERVATION, period__contains=now,
        reservation__status__in=HOLDING_STATUSES,
    )
    still_on_it = Allocation.objects.filter(
        Q(active=True) | Q(reservation__status=ReservationStatus.CANCELLED),  # a cancel releases at once
        Exists(VirtualCluster.objects.filter(
            reservation_id=OuterRef("reservation_id"),
            status__in=(ClusterStatus.READY, ClusterStatus.DEGRADED, ClusterStatus.TEARING_DOWN),
        )),
        node_id=OuterRef("node_id"), kind=AllocationKind.RESERVATION, period__startswith__lte=now,
    )
    healed = (
        Repair.objects.filter(node_id=OuterRef("node_id"), remediated_at__isnull=False)
        .order_by().values("node_id").annotate(last=Max("remediated_at")).values("last")
    )
    rows = (
        HealthCheck.objects.filter(pk__in=list(check_ids), status=CheckStatus.QUEUED)
        .annotate(busy=Exists(busy) | Exists(still_on_it), healed=Subquery(healed))
        .values_list(
            "pk", "level", "trigger", "reservation_id", "node__hostname", "node__pool__gpu_model",
            "node__pool__gpus_per_node", "busy", "healed", "node_id",
        )
        .order_by("pk")
    )
    rows = list(rows)
    maintained = list(Node.objects.filter(hostname__in=[r[4] for r in rows if not r[7]], state=NodeState.MAINTENANCE)
                      .only("pk", "hostname", "state", "state_reason"))
    held = nodes_held_after_failed_teardown(maintained)
    held_hosts = {node.hostname for node in maintained if node.pk in held}
    peers: dict[int, list[str]] = {}
    for reservation_id in {r[3] for r in rows if r[3] is not None and r[1] == CheckLevel.FULL}:
        peers[reservation_id] = list(
            Allocation.objects.filter(reservation_id=reservation_id, active=True)
            .order_by("node__hostname").values_list("node__hostname", flat=True)
        )
    # The CUDA version each cluster chose: the agent fails a node whose driver cannot run it. Only checks of a
    # booking's nodes (the gate's, a tenant's or staff's of a cluster) have one; an idle node's sweep has none.
    cuda_min = dict(
        VirtualCluster.objects.filter(reservation_id__in={r[3] for r in rows if r[3] is not None})
        .values_list("reservation_id", "cuda_version")
    )
    repair_cuda_min = _repair_cuda_min({r[9] for r in rows})
    pins = conf.pins()
    simulated = conf.agent_queue_mode() == "fleet"
    jobs = []
    for pk, level, trigger, reservation_id, host, model, gpus, is_busy, healed_at, node_id in rows:
        job: dict[str, Any] = {
            "id": pk,
            "host": host,
            "level": level,
            "model": model,
            "gpus": gpus,
            "idle": not is_busy and host not in held_hosts,
            "peers": [p for p in peers.get(reservation_id, []) if p != host],
            "pins": pins,
            "cuda_min": _newest_cuda(cuda_min.get(reservation_id), repair_cuda_min.get(node_id)),
            # Scheduled checks keep passing readings as names only; anything a person asked for in full.
            "detail": "compact" if trigger == CheckTrigger.SCHEDULE else "full",
        }
        if simulated:
            job["heal"] = healed_at.timestamp() if healed_at else None
        jobs.append(job)
    return jobs


def _repair_cuda_min(node_ids: Iterable[int]) -> dict[int, str]:
    """Return, per node, the CUDA version a failing ``cuda_support`` check required when it opened the node's
    open repair (the version the check stored as its expected value); nodes without one are left out."""
    out: dict[int, str] = {}
    repairs = (
        Repair.objects.filter(
            node_id__in=list(node_ids), state__in=OPEN_REPAIR_STATES,
            triggering_check__report__node_checks__contains=[{"name": "cuda_support", "status": "fail"}],
        )
        .values_list("node_id", "triggering_check__report")
    )
    for node_id, report in repairs:
        for check in (report or {}).get("node_checks") or []:
            if not isinstance(check, Mapping) or (check.get("name"), check.get("status")) != ("cuda_support", "fail"):
                continue
            required = check.get("threshold")
            if isinstance(required, str) and cuda_major_minor(required) is not None:
                out[node_id] = _newest_cuda(out.get(node_id), required) or required
    return out


def _newest_cuda(*versions: str | None) -> str | None:
    """Return the newest of the CUDA versions given (compared as numbers), None when none is one."""
    known = [v for v in versions if v and cuda_major_minor(v) is not None]
    if not known:
        return next((v for v in versions if v), None)  # an unreadable one reaches the agent, which says so
    return max(known, key=cuda_major_minor)


# What a scheduled check reads when its node's agent has not picked up the previous message.
AGENT_NOT_ANSWERING = "the agent is not answering"

def _waiting_in_agent_queues(queues: Sequence[str]) -> dict[str, int]:
    """Return the messages waiting in each node agent's queue, read in one round trip to the broker
    ({} when it cannot be read: the checks are then sent as before)."""
    from . import tasks

    try:
        with tasks.agent_run.app.connection_for_read() as conn:
            return queue_lengths(conn.default_channel.client, queues)
    except Exception:  # noqa: BLE001 - any broker error: send, as before
        logger.warning("could not read the node agents' queue lengths", exc_info=True)
        return {}


def _dispatch_scheduled(check_ids: Sequence[int]) -> int:
    """Send the sweep's checks, but not to a node agent whose queue still holds an earlier message.

    A dead agent (or a node renamed or deleted on its side) reads nothing, and Redis evicts nothing: a message
    every sweep grew its queue for ever. Such a check is recorded at once as an ``unknown`` error, "the agent is
    not answering" (as one that expired unanswered), and the first sweep after the agent emptied its queue sends
    one again. The fleet's shared queue is not held back."""
    queues = dict(HealthCheck.objects.filter(pk__in=list(check_ids), status=CheckStatus.QUEUED)
                  .exclude(agent_queue=conf.fleet_queue()).values_list("pk", "agent_queue"))
    waiting = _waiting_in_agent_queues(sorted(set(queues.values()))) if queues else {}
    held = {check_id: queue for check_id, queue in queues.items() if waiting.get(queue)}
    now = _now()
    for check_id, queue in held.items():
        HealthCheck.objects.filter(pk=check_id, status=CheckStatus.QUEUED).update(
            status=CheckStatus.ERROR, verdict=Verdict.UNKNOWN, recommended_action="investigate",
            error=f"not sent: {waiting[queue]} earlier message(s) still wait in {queue} (the agent does not read it)",
            summary=AGENT_NOT_ANSWERING, finished_at=now, handled_at=now,
        )
    return dispatch([check_id for check_id in check_ids if check_id not in held])


def dispatch(check_ids: Sequence[int]) -> int:
    """Send queued checks to their agents; return how many were sent.

    A broker failure is logged: the checks stay queued and expire into an ``unknown`` error,
    and the next sweep (or request) queues them again.
    """
    from . import tasks

    jobs = jobs_for(check_ids)
    if not jobs:
        return 0
    try:
        with tasks.fleet_run.app.producer_or_acquire() as producer:
            if conf.agent_queue_mode() == "fleet":
                size = max(1, conf.setting_int("PORTAL_HEALTH_FLEET_BATCH", 50))
                for i in range(0, len(jobs), size):
                    tasks.fleet_run.apply_async(args=[jobs[i:i + size]], queue=conf.fleet_queue(),
                                                producer=producer)
            else:
                for job in jobs:
                    # A node that was down longer than the check may wait drops it (it expired
                    # here into "unknown" already); a burn-in may run past the default task limit.
                    limit = conf.level_timeout_s(job["level"])
                    tasks.agent_run.apply_async(
                        args=[job], queue=conf.node_queue(job["host"]), producer=producer, expires=limit,
                        soft_time_limit=limit, time_limit=limit + 60,
                    )
    except Exception:  # noqa: BLE001 - any broker error: the checks expire and are queued again
        logger.warning("could not send %d health checks; they will expire", len(jobs), exc_info=True)
        return 0
    return len(jobs)


# --- recording ----------------------------------------------------------------------------------


def health_checks_mark_running(check_ids: Sequence[int]) -> int:
    """Mark queued checks as running (an agent picked them up)."""
    return HealthCheck.objects.filter(pk__in=list(check_ids), status=CheckStatus.QUEUED).update(
        status=CheckStatus.RUNNING, started_at=_now()
    )


def _summary(verdict: str, problems: Sequence[Mapping[str, Any]]) -> str:
    if not problems:
        return "all checks passed" if verdict == Verdict.PASS else verdict
    rank = {"fail": 0, "unknown": 1, "warn": 2}
    worst = sorted(problems, key=lambda p: rank.get(p.get("status"), 3))[:3]
    parts = [
        f"{'node' if p.get('gpu') is None else 'gpu' + str(p.get('gpu'))} {p.get('check')}: {p.get('message')}"
        for p in worst
    ]
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return ("; ".join(parts) + more)[:500]


def _clean(report: Any) -> tuple[dict[str, Any], str]:
    """Return (report, error): a report an agent posted, checked enough to store and act on.

    Agents run on tenant-reachable machines; a malformed or oversized report is stored as an
    ``unknown`` verdict with the reason, never trusted as a pass.
    """
    unreadable = {"verdict": Verdict.UNKNOWN, "recommended_action": "investigate", "problems": [], "gpus": []}
    if not isinstance(report, Mapping):
        return unreadable, "the agent posted no report"
    size = len(json.dumps(report, default=str))
    if size > MAX_REPORT_BYTES:
        return unreadable, f"report too large ({size} bytes)"
    report = dict(report)
    error = ""
    if report.get("verdict") not in Verdict.values:
        error = f"report without a valid verdict ({str(report.get('verdict'))[:40]!r})"
        report["verdict"] = Verdict.UNKNOWN
    if report.get("recommended_action") not in RecommendedAction.values:
        report["recommended_action"] = "investigate" if report["verdict"] != Verdict.PASS else "none"
    problems = report.get("problems") if isinstance(report.get("problems"), list) else []
    report["problems"] = [_clean_problem(p) for p in problems if isinstance(p, Mapping)]
    gpus = report.get("gpus") if isinstance(report.get("gpus"), list) else []
    report["gpus"] = [_clean_gpu(gpu) for gpu in gpus if isinstance(gpu, Mapping)]
    return report, error


def _clean_gpu(gpu: Mapping[str, Any]) -> dict[str, Any]:
    """Return one GPU's results with the shape pages and the API read: a known verdict and action, text
    identity fields, its checks as objects with text fields, the names of its passed checks."""
    out = dict(gpu)
    index = gpu.get("index")
    out["index"] = index if isinstance(index, int) and not isinstance(index, bool) else None
    for key in ("uuid", "serial", "name", "pci_bus_id"):
        value = gpu.get(key)
        out[key] = None if value is None else str(value)
    if gpu.get("verdict") not in Verdict.values:
        out["verdict"] = Verdict.UNKNOWN
    if gpu.get("action") not in RecommendedAction.values:
        out["action"] = "none" if out["verdict"] == Verdict.PASS else "investigate"
    checks = gpu.get("checks") if isinstance(gpu.get("checks"), list) else []
    # Each check keeps its readings (value, threshold) as posted; the fields pages print are text.
    out["checks"] = [{**check, **{key: _text(check.get(key)) for key in ("name", "status", "message", "action")}}
                     for check in checks if isinstance(check, Mapping)]
    if "passed" in gpu:  # a compact report's (runner.compact_report)
        passed = gpu["passed"] if isinstance(gpu["passed"], list) else []
        out["passed"] = [name for name in passed if isinstance(name, str)]
    return out


def _clean_problem(problem: Mapping[str, Any]) -> dict[str, Any]:
    """Return one listed problem with the shape summaries, events and pages read (text fields, GPU index)."""
    gpu = problem.get("gpu")
    out: dict[str, Any] = {"gpu": gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None}
    for key in ("check", "status", "action", "message"):
        out[key] = _text(problem.get(key))
    # Summaries, the node's reason and the failure events reach the teams booked on the node, who never see
    # another team's processes (an older agent named them here); the GPU results keep them for staff.
    out["message"] = without_processes(out["message"])
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _row(check_id: int, report: Any) -> tuple:
    report, error = _clean(report)
    verdict = report["verdict"]
    gpus, rest = split_report(report)
    summary = error or _summary(verdict, report["problems"])
    return (int(check_id), verdict, report["recommended_action"], summary, json.dumps(gpus, default=str),
            json.dumps(rest, default=str), error[:500])


_RECORD_SQL = """
    UPDATE health_healthcheck h
    SET status = %(done)s, verdict = v.verdict, recommended_action = v.action, summary = v.summary,
        gpu_results = v.gpus::jsonb, report = v.rest::jsonb, error = v.error,
        started_at = coalesce(h.started_at, %(now)s), finished_at = %(now)s,
        handled_at = CASE WHEN v.verdict = %(fail)s OR h.trigger = %(repair)s
                               OR EXISTS (SELECT 1 FROM health_repair r WHERE r.retest_check_id = h.id)
                          THEN NULL ELSE %(now)s END
    FROM (
        SELECT unnest(%(ids)s::bigint[]) AS id, unnest(%(verdicts)s::text[]) AS verdict,
               unnest(%(actions)s::text[]) AS action, unnest(%(summaries)s::text[]) AS summary,
               unnest(%(gpus)s::text[]) AS gpus, unnest(%(rests)s::text[]) AS rest,
               unnest(%(errors)s::text[]) AS error
    ) v
    WHERE h.id = v.id AND h.status = ANY(%(open)s)
    RETURNING h.id, h.handled_at IS NULL
"""


def health_checks_record(results: Iterable[tuple[int, Any]]) -> dict[str, int]:
    """Store agents' reports (check id, report) in one statement, then apply what the verdicts mean.

    Idempotent: a report for a check that is no longer open (a redelivered message, an expired
    check) changes nothing. Returns {"recorded": n, "handled": m}.
    """
    rows = [_row(check_id, report) for check_id, report in results]
    if not rows:
        return {"recorded": 0, "handled": 0}
    columns = list(zip(*rows, strict=True))
    params = {
        "ids": list(columns[0]), "verdicts": list(columns[1]), "actions": list(columns[2]),
        "summaries": list(columns[3]), "gpus": list(columns[4]), "rests": list(columns[5]),
        "errors": list(columns[6]), "done": CheckStatus.DONE, "fail": Verdict.FAIL, "repair": CheckTrigger.REPAIR,
        "open": list(OPEN_CHECK_STATUSES), "now": _now(),
    }
    with connection.cursor() as cur:
        cur.execute(_RECORD_SQL, params)
        recorded = cur.fetchall()
    pending = sorted(check_id for check_id, unhandled in recorded if unhandled)
    left = _handle_each(pending)
    return {"recorded": len(recorded), "handled": len(pending) - left}


def _handle_each(check_ids: Iterable[int]) -> int:
    """Handle each check; one whose bookings' move stays busy (Busy: nothing of that move written) is left
    unhandled for health_maintain's re-run, and does not hold up the ones after it. Return how many were left.

    Not raised to the recording task: its retry would find the report stored (the check no longer open) and
    handle nothing, and an agent's report stored must be acknowledged (record_report) all the same."""
    left = 0
    for check_id in check_ids:
        try:
            health_check_handle(check_id)
        except Busy as exc:
            logger.warning("health check #%s: handling left for the upkeep's re-run: %s", check_id, exc.detail)
            left += 1
    return left


def health_check_record(check_id: int, report: Any) -> HealthCheck:
    """Store one agent's report and apply what its verdict means; return the check."""
    health_checks_record([(check_id, report)])
    return HealthCheck.objects.select_related("node").get(pk=check_id)


def _affected_tenant_ids(node_id: int, now: datetime) -> list[int]:
    return sorted(set(
        Allocation.objects.filter(
            node_id=node_id, active=True, kind=AllocationKind.RESERVATION, period__endswith__gt=now,
            reservation__status__in=HOLDING_STATUSES,
        ).values_list("reservation__tenant_id", flat=True)
    ))


def health_check_handle(check_id: int) -> None:
    """Apply a finished check's consequences once: a repair's re-test, or drain and repair on fail."""
    node_id = HealthCheck.objects.filter(pk=check_id).values_list("node_id", flat=True).first()
    if node_id is None:
        return
    with _node_lock(node_id):
        check = HealthCheck.objects.select_related("node").get(pk=check_id)
        if check.handled_at is not None or check.is_open:
            return
        # A repair's re-test may be any open medium check it reused, not only a "repair" one.
        _retest_finished(check)
        if check.verdict == Verdict.FAIL:
            _fail_consequences(check)
        HealthCheck.objects.filter(pk=check_id, handled_at__isnull=True).update(handled_at=_now())


def _fail_consequences(check: HealthCheck) -> None:
    """A failing check: take an in-service node out (drain, repair, move bookings) and announce."""
    now = _now()
    node = Node.objects.get(pk=check.node_id)
    tenant_ids = _affected_tenant_ids(node.pk, now)
    reason = f"health check #{check.pk} ({check.level}) failed: {check.summary}"
    took_out = staff_work = False
    repair = Repair.objects.filter(node=node, state__in=OPEN_REPAIR_STATES).order_by("-pk").first()
    # A scheduled check of a node staff put in maintenance is recorded (the node's page shows it) and told
    # to staff, nothing more: staff's hands-on work is not turned into a repair (see _staff_maintenance).
    if node.state in IN_SERVICE_STATES and repair is None:
        staff_work = _staff_maintenance(node, check)
        if not staff_work:
            repair = _take_out_of_service(node=node, actor=None, reason=reason, check=check)
            took_out = repair is not None
            if repair is None:  # staff moved the node meanwhile: to maintenance, or out of service
                node = Node.objects.get(pk=node.pk)
                staff_work = _staff_maintenance(node, check)
    elif repair is not None and repair.triggering_check_id == check.pk:
        # This check opened the repair in a run that died before it finished (moving the bookings,
        # announcing): finish it now. Moving again finds only what is left to move.
        _move_bookings_of(repair, node=node, actor=None, reason=reason)
        took_out = True
    if took_out:
        # Teams whose bookings an earlier, unfinished run of this handling moved off already were on the node
        # too: the repair's outcomes name their bookings.
        moved = [o["reservation_id"] for o in repair.outcomes if o.get("reservation_id")]
        tenant_ids = sorted({*tenant_ids, *Reservation.objects.filter(pk__in=moved).values_list("tenant_id",
                                                                                               flat=True)})
        # The state the handling left the node in: drained from service, or held where it was (a node in
        # maintenance after a failed teardown stays there; the repair keeps it out).
        state = Node.objects.filter(pk=node.pk).values_list("state", flat=True).get()
        events.emit(
            "node.failed", node_id=node.pk, node=node.hostname, state=state, reason=reason[:500],
            check_id=check.pk, repair_id=repair.pk, recommended_action=check.recommended_action,
            tenant_ids=tenant_ids, outcomes=repair.outcomes,
        )
    # A scheduled check failing again on a node already out of service is old news; on a node in staff's
    # maintenance it is news once per maintenance period and failure (_staff_told).
    if took_out or check.trigger != CheckTrigger.SCHEDULE or (staff_work and not _staff_told(node, check)):
        events.emit(
            "health_check.failed", check_id=check.pk, node_id=node.pk, node=node.hostname, level=check.level,
            trigger=check.trigger, verdict=check.verdict, recommended_action=check.recommended_action,
            problems=[
                {k: p.get(k) for k in ("gpu", "check", "status", "action", "message")}
                for p in check.problems if p.get("status") != "pass"
            ][:MAX_EVENT_PROBLEMS],
            # Staff's own work in progress is told to staff: the tenants booked after it hear nothing.
            tenant_ids=[] if staff_work else tenant_ids, reservation_id=check.reservation_id,
        )


def _staff_maintenance(node: Node, check: HealthCheck | None) -> bool:
    """Tell whether a scheduled check's failure finds the node under staff's hands-on work with no repair: in
    maintenance, or in a maintenance window staff scheduled (the node stays available then; the window keeps
    bookings off it). The sweep records it but opens no repair, which would hold the node from staff's own
    return of it, nor drains it, which would move the bookings after the window (maintenance never moves one).

    A node the portal itself holds after a failed teardown is no staff work: a failure there opens a repair,
    which keeps the node out when the retried teardown gives it back, until its re-test passes.
    """
    if check is None or check.trigger != CheckTrigger.SCHEDULE:
        return False
    if node.state == NodeState.MAINTENANCE:
        return failed_teardown_hold(node) is None
    return node.state in IN_SERVICE_STATES and _maintenance_window_start(node, check) is not None


def _maintenance_window_start(node: Node, check: HealthCheck) -> datetime | None:
    """Return the start of staff's maintenance window on the node that the check ran in, if any."""
    window = (
        Allocation.objects.filter(node_id=node.pk, kind=AllocationKind.MAINTENANCE, active=True,
                                  period__contains=check.started_at or check.created_at)
        .values_list("period", flat=True).first()
    )
    return window.lower if window is not None else None


def _failing(check: HealthCheck) -> frozenset[tuple[Any, Any]]:
    """What fails in a check: its failing (gpu, check) pairs (readings and messages left out)."""
    return frozenset((p.get("gpu"), p.get("check")) for p in check.problems if p.get("status") == Verdict.FAIL)


def _staff_told(node: Node, check: HealthCheck) -> bool:
    """Tell whether staff already heard of this failure of a node in their maintenance: the node's last
    scheduled check handled since it went into maintenance (its latest move there, or the start of the
    maintenance window the check ran in) failed the same way.
    A pass in between, or another failure, is news again; so is the next maintenance period.
    """
    since = (
        AuditLog.objects.filter(object_type=Node._meta.label_lower, object_id=str(node.pk), action="node.update",
                                after__state=NodeState.MAINTENANCE)
        .exclude(before__state=NodeState.MAINTENANCE)
        .order_by("-created_at", "-pk").values_list("created_at", flat=True).first()
    )
    if node.state != NodeState.MAINTENANCE:  # a maintenance window: the period is the window
        since = _maintenance_window_start(node, check)
    earlier = HealthCheck.objects.filter(
        node_id=node.pk, trigger=CheckTrigger.SCHEDULE, status=CheckStatus.DONE, handled_at__isnull=False,
        verdict__in=(Verdict.PASS, Verdict.WARN, Verdict.FAIL),
    ).exclude(pk=check.pk)
    if since is not None:
        earlier = earlier.filter(handled_at__gte=since)
    previous = earlier.order_by("-handled_at", "-pk").first()
    return previous is not None and previous.verdict == Verdict.FAIL and _failing(previous) == _failing(check)


def _take_out_of_service(*, node: Node, actor: Any, reason: str, check: HealthCheck | None) -> Repair | None:
    """Drain the node, open its repair and move its bookings; return the repair. Hold the node lock.

    Return None, changing nothing, when the node left service (staff retired or failed it) between the
    caller's read and the drain's locks: that change stands, as it would had it come first.
    """
    if node.state == NodeState.AVAILABLE:
        node = node_update(actor=actor, node=node, state=NodeState.DRAINING, reason=reason[:255],
                           only_from=(NodeState.AVAILABLE,))
        if node.state not in IN_SERVICE_STATES or _staff_maintenance(node, check):
            return None
    repair = _repair_create(node=node, actor=actor, reason=reason, check=check)
    _move_bookings_of(repair, node=node, actor=actor, reason=reason)
    return repair


def _move_bookings_of(repair: Repair, *, node: Node, actor: Any, reason: str) -> None:
    """Move the node's bookings off it and add what happened to each to the repair's outcomes.

    A move that keeps losing to concurrent changes raises Busy (the handling's re-run moves what is left): the
    moves done before it are recorded first, as a second run no longer finds those bookings on the node.
    """
    try:
        outcomes = _move_bookings(node=node, actor=actor, reason=reason)
    except Busy as exc:
        _add_outcomes(repair, getattr(exc, "outcomes", []))
        raise
    _add_outcomes(repair, outcomes)


def _add_outcomes(repair: Repair, outcomes: list[dict[str, Any]]) -> None:
    if outcomes:
        repair.outcomes = [*repair.outcomes, *outcomes]
        Repair.objects.filter(pk=repair.pk).update(outcomes=repair.outcomes)


def _move_bookings(*, node: Node, actor: Any, reason: str) -> list[dict[str, Any]]:
    """Move the out-of-service node's running and future bookings to spares, or degrade them.

    PORTAL_HEALTH_MOVE_BOOKINGS=False leaves that to whoever follows ``node.state_changed``.
    """
    if not conf.setting_bool("PORTAL_HEALTH_MOVE_BOOKINGS", True):
        return []
    return node_replace_allocations(node=node, actor=actor, reason=reason[:200])


def _step(state: str, actor: Any, note: str = "", at: datetime | None = None) -> dict[str, Any]:
    return {"state": state, "at": (at or _now()).isoformat(), "actor": _username(actor), "note": note[:500]}


def _repair_event(repair: Repair, previous: str, actor: Any, note: str, hostname: str) -> None:
    events.emit(
        "repair.changed", repair_id=repair.pk, node_id=repair.node_id, node=hostname, state=repair.state,
        previous=previous, actor=_username(actor), note=note[:500],
    )


def _repair_create(*, node: Node, actor: Any, reason: str, check: HealthCheck | None) -> Repair:
    """Open the node's repair (or return the open one: one per node, the database says)."""
    try:
        with transaction.atomic():
            repair = Repair.objects.create(
                node=node, reason=reason[:500], triggering_check=check,
                recommended_action=check.recommended_action if check else "",
                opened_by=actor if getattr(actor, "pk", None) else None,
                steps=[_step(RepairState.RECOMMENDED, actor, reason)],
            )
            audit_record(actor=actor, action="repair.recommended", obj=repair,
                         after={"node": node.hostname, "reason": reason[:500],
                                "check": check.pk if check else None,
                                "recommended_action": repair.recommended_action})
            _repair_event(repair, "", actor, reason, node.hostname)
    except IntegrityError:
        repair = Repair.objects.get(node=node, state__in=OPEN_REPAIR_STATES)
    return repair


REPAIR_REASON_MAX = 500  # Repair.reason's length


def repair_open(*, actor: Any, node: Node, reason: str) -> Repair:
    """Take a node out of service by hand (staff): drain it, open a repair, move its bookings."""
    if not getattr(actor, "is_staff", False):
        raise PermissionDenied("Only platform staff can open repairs.")
    reason = (reason or "").strip()
    if not reason:
        raise InvalidInput("Say why the node needs repair.", fields={"reason": "This field is required."})
    if len(reason) > REPAIR_REASON_MAX:  # a longer one was cut silently on its way to the node and the repair
        raise InvalidInput(f"reason: at most {REPAIR_REASON_MAX} characters.",
                           fields={"reason": f"At most {REPAIR_REASON_MAX} characters."})
    with _node_lock(node.pk):
        node = Node.objects.get(pk=node.pk)
        if node.state not in IN_SERVICE_STATES:
            raise InvalidState(f"{node.hostname} is {node.state}.")
        if Repair.objects.filter(node=node, state__in=OPEN_REPAIR_STATES).exists():
            raise InvalidState(f"{node.hostname} already has an open repair.")
        try:
            repair = _take_out_of_service(node=node, actor=actor, reason=reason, check=None)
        except Busy as exc:
            # The node is drained and its repair open (committed; the moves done are recorded): they stand, as
            # "busy, nothing was changed" would be untrue and trying again is refused (an open repair). The
            # node's sync (node.state_changed) moves what is left, retrying while it stays busy.
            logger.warning("repair of %s: moving its bookings left to the node's sync: %s", node.hostname,
                           exc.detail)
            repair = Repair.objects.filter(node=node, state__in=OPEN_REPAIR_STATES).order_by("-pk").first()
        if repair is None:
            node = Node.objects.get(pk=node.pk)
            raise InvalidState(f"{node.hostname} is {node.state}.")
        return repair


def repair_advance(*, actor: Any, repair: Repair, to: str, note: str = "") -> Repair:
    """Move a repair one step (staff); audited, announced, with the node following its state.

    accepted: the node stays drained · cordoned: maintenance, bookings moved off ·
    remediating: a person works on it · retesting: a medium check is queued · rejoined (only
    after a passing re-test): available again · failed: the node is marked failed.
    """
    if not getattr(actor, "is_staff", False):
        raise PermissionDenied("Only platform staff can work on repairs.")
    if to not in RepairState.values:
        raise InvalidInput(f"Unknown repair step {to!r}.", fields={"to": "Choose a repair state."})
    note = (note or "").strip()[:500]
    with _node_lock(repair.node_id):
        with transaction.atomic(durable=True):
            repair = (Repair.objects.select_for_update(of=("self",)).select_related("node", "retest_check")
                      .get(pk=repair.pk))
            previous = repair.state
            if to not in REPAIR_TRANSITIONS[previous]:
                raise InvalidState(f"Repair #{repair.pk} is {previous}; it cannot go to {to}.")
            if to == RepairState.REJOINED:
                retest = repair.retest_check
                if retest is None or retest.is_open or retest.verdict not in ACCEPTABLE_VERDICTS:
                    raise InvalidState(f"Repair #{repair.pk} needs a passing re-test before the node rejoins.")
            now = _now()
            if to == RepairState.RETESTING:
                # A medium check of the node still open from before the remediation (the last re-test, or
                # staff's) would be reused as this one, its result read before the fix: close it first.
                HealthCheck.objects.filter(
                    node_id=repair.node_id, level=CheckLevel.MEDIUM, reservation__isnull=True,
                    status__in=OPEN_CHECK_STATUSES, created_at__lt=repair.remediated_at,
                ).update(
                    status=CheckStatus.ERROR, verdict=Verdict.UNKNOWN, recommended_action="investigate",
                    error=f"superseded: queued before repair #{repair.pk}'s remediation; a new re-test replaces it",
                    summary="superseded by a re-test", finished_at=now, handled_at=now,
                )
                retest = health_checks_request(
                    nodes=[repair.node_id], level=CheckLevel.MEDIUM, trigger=CheckTrigger.REPAIR, actor=actor
                )[0]
                repair.retest_check = retest
                note = note or f"re-test: medium check #{retest.pk}"
            if to == RepairState.REMEDIATING:
                repair.remediated_at = now
            repair.state = to
            repair.steps = [*repair.steps, _step(to, actor, note, now)]
            if to not in OPEN_REPAIR_STATES:
                repair.closed_at = now
            repair.save()
            audit_record(actor=actor, action=f"repair.{to}", obj=repair, before={"state": previous},
                         after={"state": to, "note": note, "node": repair.node.hostname})
            _repair_event(repair, previous, actor, note, repair.node.hostname)
        _node_follows(repair, actor=actor)
    return repair


# The node state each repair state implies (None: leave it).
_NODE_STATE_FOR_REPAIR: dict[str, str | None] = {
    RepairState.RECOMMENDED: NodeState.DRAINING,
    RepairState.ACCEPTED: NodeState.DRAINING,
    RepairState.CORDONED: NodeState.MAINTENANCE,
    RepairState.REMEDIATING: NodeState.MAINTENANCE,
    RepairState.RETESTING: NodeState.MAINTENANCE,
    RepairState.REJOINED: NodeState.AVAILABLE,
    RepairState.FAILED: NodeState.FAILED,
}


def _node_follows(repair: Repair, *, actor: Any, stands: tuple[str, ...] = (NodeState.RETIRED,)) -> bool:
    """Bring the node to the state its repair implies; return whether it changed. Hold the node lock.

    Runs after the repair's own transaction (node_update is durable); :func:`repairs_reconcile`
    repeats it for any repair whose worker died in between. A node in one of ``stands`` is left as it is
    (retired always; the upkeep adds failed, see there).
    """
    node = Node.objects.get(pk=repair.node_id)
    wanted = _NODE_STATE_FOR_REPAIR[repair.state]
    if wanted is None or node.state == wanted or node.state in stands:
        return False
    if wanted == NodeState.DRAINING and node.state != NodeState.AVAILABLE:
        return False  # already further out of service than draining
    if repair.state == RepairState.REJOINED:
        latest = Repair.objects.filter(node_id=node.pk).order_by("-opened_at", "-pk").values_list("pk", flat=True)
        if latest.first() != repair.pk:
            return False  # a newer repair owns the node now
        held_for = failed_teardown_hold(node)
        if held_for is not None:
            # The GPUs are fine again, but the failed tenant's cluster may still be on the node: it stays held
            # until the retried teardown of that cluster succeeds and gives it back.
            logger.info("node %s rejoined by repair #%s stays held for cluster #%s's failed teardown",
                        node.hostname, repair.pk, held_for)
            return False
    reason = "" if wanted == NodeState.AVAILABLE else f"repair #{repair.pk}: {repair.state}"
    # The same rules again under the node's locks: a change staff made since the read above stands.
    allowed = ((NodeState.AVAILABLE,) if wanted == NodeState.DRAINING
               else tuple(s for s in NodeState.values if s not in stands))
    node = node_update(actor=actor, node=node, state=wanted, reason=reason, only_from=allowed)
    if node.state != wanted:
        return False
    if wanted != NodeState.AVAILABLE:
        try:
            outcomes = _move_bookings(node=node, actor=actor, reason=reason)
        except Busy as exc:
            # The step and the node's change are committed: they stand (a Busy here told staff "nothing was
            # changed" of a step that was taken). The node's sync (node.state_changed) moves what is left,
            # retrying while it stays busy; the moves done so far are recorded.
            logger.warning("repair #%s: moving the bookings off %s left to the node's sync: %s", repair.pk,
                           node.hostname, exc.detail)
            outcomes = getattr(exc, "outcomes", [])
        if outcomes:
            Repair.objects.filter(pk=repair.pk).update(outcomes=[*repair.outcomes, *outcomes])
    if wanted == NodeState.FAILED:
        events.emit(
            "node.failed", node_id=node.pk, node=node.hostname, state=NodeState.FAILED, reason=repair.reason,
            check_id=repair.triggering_check_id, repair_id=repair.pk, recommended_action=repair.recommended_action,
            tenant_ids=[], outcomes=[],
        )
    return True


def _retest_finished(check: HealthCheck) -> None:
    """A repair's re-test came back: passing lets staff rejoin the node, anything else goes back."""
    repair = Repair.objects.filter(retest_check=check, state=RepairState.RETESTING).first()
    if repair is None:
        return
    with transaction.atomic():
        repair = Repair.objects.select_for_update(of=("self",)).select_related("node").get(pk=repair.pk)
        if repair.state != RepairState.RETESTING or repair.retest_check_id != check.pk:
            return
        passed = check.verdict in ACCEPTABLE_VERDICTS
        note = f"re-test #{check.pk}: {check.verdict}" + ("" if passed else f" — {check.summary}")
        previous = repair.state
        if not passed:
            repair.state = RepairState.REMEDIATING
        repair.steps = [*repair.steps, _step(repair.state, None, note)]
        repair.save()
        audit_record(actor=None, action=f"repair.retest_{'passed' if passed else 'failed'}", obj=repair,
                     before={"state": previous}, after={"state": repair.state, "check": check.pk,
                                                        "verdict": check.verdict})
        _repair_event(repair, previous, None, note, repair.node.hostname)


def node_return_blocker(node_id: int) -> str | None:
    """Why the node may not be made available now (an open repair owns it), else None: the one rule for
    staff (API, node admin) and workers alike, registered with reservations.services.node_return_blockers.

    Runs inside node_update's transaction and first waits for a health step in flight on the node (it
    holds the node's health lock while it drains the node and opens the repair), then holds that step off
    until the node's change commits: a repair opened meanwhile is seen here, never missed. The repair's own
    rejoin closes it first, so its node_update is not refused (and holds the health lock already).
    """
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", [LOCK_NODE_HEALTH, node_id])
    repair = (Repair.objects.filter(node_id=node_id, state__in=OPEN_REPAIR_STATES).order_by("-opened_at", "-pk")
              .values_list("pk", "state").first())
    if repair is None:
        return None
    return (f"repair #{repair[0]} ({repair[1]}) owns it; it returns to service through the repair's steps "
            "(re-test, then rejoin).")


def repairs_reconcile() -> int:
    """Bring every node to the state its open (or just closed) repair implies; return how many moved.

    An open repair owns its node, but a node staff marked ``failed`` (or ``retired``) stays so: no open
    repair's step sets failed, so a failed node under one is staff's decision, never a step left undone
    (the repair stays open; staff's own steps of it still move the node). A closed repair only finishes
    what its step left undone (the worker died before the node followed): once the node was changed
    after the repair closed (staff put a failed node back, or sent a rejoined one to maintenance),
    that change stands.
    """
    moved = 0
    recent = _now() - timedelta(days=1)
    repairs = Repair.objects.filter(Q(state__in=OPEN_REPAIR_STATES) | Q(closed_at__gte=recent)).order_by("pk")
    for repair in repairs:
        with _node_lock(repair.node_id):
            repair.refresh_from_db()
            if not repair.is_open and Node.objects.filter(
                pk=repair.node_id, updated_at__gt=repair.closed_at
            ).exists():
                continue
            stands = (NodeState.RETIRED, NodeState.FAILED) if repair.is_open else (NodeState.RETIRED,)
            if _node_follows(repair, actor=None, stands=stands):
                moved += 1
    return moved


# --- upkeep -------------------------------------------------------------------------------------


def health_checks_expire(*, now: datetime | None = None) -> list[int]:
    """Turn checks no agent answered within their level's time into ``unknown`` errors."""
    now = now or _now()
    expired: list[int] = []
    for level in CheckLevel.values:
        cutoff = now - timedelta(seconds=conf.level_timeout_s(level))
        with transaction.atomic():
            ids = list(
                HealthCheck.objects.select_for_update(skip_locked=True)
                .filter(status__in=OPEN_CHECK_STATUSES, level=level, created_at__lt=cutoff)
                .values_list("pk", flat=True)[:5000]
            )
            HealthCheck.objects.filter(pk__in=ids, status__in=OPEN_CHECK_STATUSES).update(
                status=CheckStatus.ERROR, verdict=Verdict.UNKNOWN, recommended_action="investigate",
                error=f"no report within {conf.level_timeout_s(level):g} s", summary="the agent did not answer",
                finished_at=now,
            )
        expired += ids
    # Repair re-tests must move their repair on; the rest need nothing more.
    retests = set(Repair.objects.filter(retest_check_id__in=expired).values_list("retest_check_id", flat=True))
    HealthCheck.objects.filter(pk__in=expired).exclude(pk__in=retests).update(handled_at=now)
    for check_id in sorted(retests):
        health_check_handle(check_id)
    return expired


def health_checks_prune(*, now: datetime | None = None, batch: int = 10_000) -> int:
    """Delete old scheduled checks, keeping each node's latest and any a repair names."""
    now = now or _now()
    days = conf.setting_int("PORTAL_HEALTH_RETENTION_DAYS", 14)
    cutoff = now - timedelta(days=days)
    sql = """
        DELETE FROM health_healthcheck WHERE id IN (
            SELECT h.id FROM health_healthcheck h
            WHERE h.trigger = %(schedule)s AND h.status IN (%(done)s, %(error)s) AND h.created_at < %(cutoff)s
              AND h.handled_at IS NOT NULL
              AND NOT EXISTS (SELECT 1 FROM health_repair r
                              WHERE r.triggering_check_id = h.id OR r.retest_check_id = h.id)
              AND EXISTS (SELECT 1 FROM health_healthcheck newer
                          WHERE newer.node_id = h.node_id AND newer.status = %(done)s
                            AND newer.finished_at > h.finished_at)
            LIMIT %(batch)s
        )
    """
    with connection.cursor() as cur:
        cur.execute(sql, {"schedule": CheckTrigger.SCHEDULE, "done": CheckStatus.DONE, "error": CheckStatus.ERROR,
                          "cutoff": cutoff, "batch": batch})
        return cur.rowcount


def health_maintain(*, now: datetime | None = None) -> dict[str, int]:
    """The beat's upkeep: expire unanswered checks, finish consequences a crash left, reconcile, prune."""
    now = now or _now()
    expired = health_checks_expire(now=now)
    stale = now - timedelta(seconds=30)
    unhandled = list(
        HealthCheck.objects.filter(
            handled_at__isnull=True, status__in=[CheckStatus.DONE, CheckStatus.ERROR], finished_at__lt=stale
        ).values_list("pk", flat=True)[:1000]
    )
    _handle_each(unhandled)  # one still busy is left for the next run
    return {
        "expired": len(expired),
        "handled": len(unhandled),
        "reconciled": repairs_reconcile(),
        "pruned": health_checks_prune(now=now),
    }


# --- the acceptance gate --------------------------------------------------------------------------


# An acceptance node state: its check came back unknown and is run again once retry_after old.
RERUN_SOON = "rerun"


def acceptance_verdict(
    node_ids: Sequence[int], *, level: str = CheckLevel.MEDIUM, reservation_id: int | None = None
) -> tuple[bool, dict[str, Any]]:
    """Decide whether these nodes may be handed over: each must pass (or warn) a check of ``level``.

    Runs (queues) the checks that are missing and records them against the booking; returns
    ``(passed, summary)`` at once, summary = {"state": "passed" | "failed" | "pending",
    "detail": str, "nodes": {hostname: verdict or status}, "check_ids": [...]}. Call again
    while ``pending``. An ``unknown`` result is run again once it is
    PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS old and waited for meanwhile (``pending``), until the gate's
    deadline for the node (one check's timeout of the level since the gate began checking it); after
    that ``unknown`` fails, as a node never answering does. A node still serving another booking
    right now gets a quick check only (active tests would disturb that tenant); a failing node is
    drained and its booking moved to a spare, after which it is no longer among the caller's nodes
    (until that is done, its failing check reads as still running).
    """
    level = _validate_level(level)
    now = _now()
    nodes = {n.pk: n for n in Node.objects.filter(pk__in=list(node_ids)).select_related("pool")}
    if not nodes:
        return False, {"state": "failed", "detail": "no nodes to check", "nodes": {}, "check_ids": []}
    busy_elsewhere = set(
        Allocation.objects.filter(node_id__in=nodes, active=True, kind=AllocationKind.RESERVATION,
                                  period__contains=now, reservation__status__in=HOLDING_STATUSES)
        .exclude(reservation_id=reservation_id).values_list("node_id", flat=True)
    )
    max_age = timedelta(seconds=conf.setting_float("PORTAL_HEALTH_ACCEPTANCE_MAX_AGE", 21600))
    retry_after = timedelta(seconds=conf.setting_float("PORTAL_HEALTH_ACCEPTANCE_RETRY_SECONDS", 10))
    recent = (
        HealthCheck.objects.filter(node_id__in=nodes, reservation_id=reservation_id, trigger=CheckTrigger.ACCEPTANCE,
                                   created_at__gte=now - max_age)
        .order_by("node_id", "-created_at", "-pk").distinct("node_id")
    )
    latest = {c.node_id: c for c in recent}
    # When the gate began checking each node for this booking: it waits for an unknown result's re-run
    # for as long as one check of the level may take from there (its deadline), then fails on it.
    first_checked = dict(
        HealthCheck.objects.filter(node_id__in=nodes, reservation_id=reservation_id, trigger=CheckTrigger.ACCEPTANCE,
                                   created_at__gte=now - max_age)
        .order_by().values("node_id").annotate(first=Min("created_at")).values_list("node_id", "first")
    )
    to_queue: dict[str, list[int]] = {}
    states: dict[str, str] = {}
    check_ids: list[int] = []
    for node_id, node in sorted(nodes.items(), key=lambda item: item[1].hostname):
        wanted = CheckLevel.QUICK if node_id in busy_elsewhere else level
        check = latest.get(node_id)
        usable = check is not None and LEVEL_RANK[check.level] >= LEVEL_RANK[wanted]
        stale_bad = (
            usable and not check.is_open and check.verdict not in ACCEPTABLE_VERDICTS and check.verdict != Verdict.FAIL
            and check.finished_at is not None and check.finished_at < now - retry_after
        )
        if not usable or stale_bad:
            to_queue.setdefault(wanted, []).append(node_id)
            states[node.hostname] = CheckStatus.QUEUED
            continue
        check_ids.append(check.pk)
        if check.verdict == Verdict.FAIL and check.handled_at is None:
            # Stored, but its consequences (drain, the swap to a spare) are still to run: wait for them.
            states[node.hostname] = CheckStatus.RUNNING
            continue
        deadline = first_checked.get(node_id, check.created_at) + timedelta(seconds=conf.level_timeout_s(wanted))
        if not check.is_open and check.verdict == Verdict.UNKNOWN and now < deadline:
            # Too fresh to run again yet (stale_bad above re-queues it once it is retry_after old): wait for
            # that re-run rather than fail the provisioning attempt on an answer that is run again anyway.
            states[node.hostname] = RERUN_SOON
            continue
        states[node.hostname] = check.status if check.is_open else check.verdict
    reservation = Reservation.objects.filter(pk=reservation_id).first() if reservation_id else None
    for wanted, ids in to_queue.items():
        for check in health_checks_request(nodes=ids, level=wanted, trigger=CheckTrigger.ACCEPTANCE,
                                           reservation=reservation):
            check_ids.append(check.pk)
    bad = {host: s for host, s in states.items() if s in (Verdict.FAIL, Verdict.UNKNOWN)}
    waiting = {host: s for host, s in states.items() if s in OPEN_CHECK_STATUSES or s == RERUN_SOON}
    if bad:
        state, passed = "failed", False
        detail = "health checks failed: " + ", ".join(f"{h} ({s})" for h, s in sorted(bad.items()))
    elif waiting:
        state, passed = "pending", False
        reruns = sorted(host for host, s in waiting.items() if s == RERUN_SOON)
        detail = f"health checks running on {len(waiting)} of {count_of(len(states), 'node')}" + (
            f" ({', '.join(reruns)}: unknown, run again shortly)" if reruns else "")
    else:
        state, passed = "passed", True
        warned = sorted(h for h, s in states.items() if s == Verdict.WARN)
        detail = f"{count_of(len(states), 'node')} passed {level} health checks" + (
            f" (warnings: {', '.join(warned)})" if warned else "")
    return passed, {"state": state, "detail": detail, "nodes": states, "check_ids": sorted(check_ids)}


def health_acceptance_gate(*, cluster: Any) -> Any:
    """The provisioning acceptance gate backed by health checks (PORTAL_ACCEPTANCE_GATE points here).

    Returns provisioning's GateResult; raises its RetryLater while checks are still running,
    so waiting does not count as a failed attempt.
    """
    from provisioning.services import GateResult, RetryLater

    node_ids = list(
        Allocation.objects.filter(reservation_id=cluster.reservation_id, active=True).values_list("node_id", flat=True)
    )
    level = conf.setting("PORTAL_HEALTH_ACCEPTANCE_LEVEL", CheckLevel.MEDIUM)
    passed, summary = acceptance_verdict(node_ids, level=level, reservation_id=cluster.reservation_id)
    if summary["state"] == "pending":
        raise RetryLater(conf.setting_float("PORTAL_HEALTH_ACCEPTANCE_POLL", 5.0), summary["detail"])
    missing = Reservation.objects.filter(pk=cluster.reservation_id).values_list("missing_nodes", flat=True).first()
    detail = summary["detail"] + (f"; {count_of(missing, 'node')} missing: no spare was free" if missing else "")
    return GateResult(passed, detail, summary["nodes"])

