"""Booking writes (DESIGN §4). The exclusion constraint is the guarantee; this code only chooses."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, OperationalError, ProgrammingError, connection, transaction
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone
from django.utils.dateformat import format as date_format

from portal.core import events
from portal.core.exceptions import (
    Busy,
    CapacityUnavailable,
    InvalidInput,
    InvalidState,
    PermissionDenied,
    QuotaExceeded,
    is_transient,
)
from portal.core.services import audit_record, refuse_stale
from portal.core.timefmt import format_utc
from portal.core.times import PAGE_TIME_FORMAT  # how the pages write an instant: "Fri 11 Dec 09:00 CET"
from portal.core.words import count_of
from tenants.choices import BOOKING_ROLES, Role
from tenants.models import Tenant
from tenants.selectors import role_of

from . import selectors
from .choices import (
    CUDA_VERSIONS,
    DEFAULT_CUDA_VERSION,
    FINAL_STATUSES,
    AllocationKind,
    Billing,
    NodeState,
    Orchestrator,
    ReservationStatus,
)
from .models import Allocation, IdempotencyKey, Node, Pool, Reservation
from .timeutil import is_aligned, slot_ceil, slot_floor

__all__ = [
    "pool_create",
    "node_create",
    "node_update",
    "node_return_blockers",
    "window_change_guards",
    "maintenance_window_create",
    "maintenance_windows_create",
    "maintenance_windows_end",
    "booking_window_problems",
    "bookable_span",
    "capacity_text",
    "reservation_create",
    "reservation_update",
    "reservation_cancel",
    "reservation_set_status",
    "request_fingerprint",
    "node_replace_allocations",
    "slot_usage_compact",
    "slot_usage_rebuild",
    "idempotency_keys_prune",
]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

EXCLUSION_VIOLATION = "23P01"
UNDEFINED_FUNCTION = "42883"
# A booking that lost a race: 23P01 arrives as IntegrityError, 40P01 as OperationalError (Django
# maps psycopg's DeadlockDetected, a TransactionRollback, there). Callers check the SQLSTATE.
_COLLISIONS = (IntegrityError, OperationalError)


class _NodeTaken(Exception):
    """A chosen node left the available state (drained, failed, retired) before its lock was ours."""


# What the booking loops retry: a lost race for a node (23P01, 40P01) or a node taken out of service meanwhile.
_RETRYABLE = (*_COLLISIONS, _NodeTaken)


def _lost_race(exc: BaseException) -> bool:
    """A node taken by another (23P01, or it left service) or a transaction lost to a concurrent one (SQLSTATE
    class 40: a deadlock, a serialization failure): running the booking again on a fresh snapshot may succeed."""
    return _lost_node(exc) or is_transient(exc)


def _lost_node(exc: BaseException) -> bool:
    """A node the attempt picked is no longer its to take (another booking won it: 23P01; or it left service):
    the one kind of loss a savepoint may try again in place. A deadlock or serialization failure is not: the
    transaction keeps every lock taken before the savepoint, so trying again there can only lose the same way;
    it goes up to a loop that runs the whole durable transaction again."""
    return isinstance(exc, _NodeTaken) or _sqlstate(exc) == EXCLUSION_VIOLATION
MAX_NAME_LENGTH = 200


# --- validation -------------------------------------------------------------------------


def _sqlstate(exc: BaseException) -> str | None:
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) or getattr(getattr(cause, "diag", None), "sqlstate", None)


_OFF_GRID = "Must sit on the pool's {}-minute slot grid."


def _grid_errors(*, start: datetime, end: datetime, slot_minutes: int) -> dict[str, str]:
    return {field: _OFF_GRID.format(slot_minutes)
            for field, value in (("start", start), ("end", end)) if not is_aligned(value, slot_minutes)}


def bookable_span(*, pool: Pool, now: datetime) -> tuple[datetime, datetime]:
    """The earliest start and the latest end a new booking in pool may have now, both on its grid: the slot
    running now, and the last slot boundary within the booking horizon. The calendar shades outside it as not
    bookable, by the rule the service refuses with."""
    horizon = now + timedelta(days=settings.PORTAL_BOOKING_HORIZON_DAYS)
    return slot_floor(now, pool.slot_minutes), slot_floor(horizon, pool.slot_minutes)


def _validate_window(
    *, pool: Pool, start: Any, end: Any, now: datetime, allow_past_start: bool = False
) -> dict[str, str]:
    errors: dict[str, str] = {}
    for field, value in (("start", start), ("end", end)):
        if not isinstance(value, datetime):
            errors[field] = "A datetime with a UTC offset is required."
        elif timezone.is_naive(value):
            errors[field] = "Give the datetime with a UTC offset (e.g. 2026-01-05T09:00:00Z)."
        elif not is_aligned(value, pool.slot_minutes):
            errors[field] = _OFF_GRID.format(pool.slot_minutes)
    if errors:
        return errors
    earliest, latest = bookable_span(pool=pool, now=now)
    if end <= start:
        errors["end"] = "Must be after start."
    if not allow_past_start and start < earliest:
        errors["start"] = "Cannot start in the past (the earliest start is the slot running now)."
    if end > latest:  # (on the grid: end > latest ⇔ end > now + horizon)
        errors["end"] = f"Beyond the booking horizon of {settings.PORTAL_BOOKING_HORIZON_DAYS} days."
    return errors


def booking_window_problems(*, pool: Pool, start: datetime, end: datetime) -> list[str]:
    """What booking [start, end) in pool now would be refused for (the past, the horizon, the grid):
    the booking form's preview says so before the user presses Book."""
    errors = _validate_window(pool=pool, start=start, end=end, now=timezone.now())
    return [f"{field.capitalize()}: {message}" for field, message in errors.items()]


def _validate_name(name: Any) -> str:
    if name is None:
        return ""
    if not isinstance(name, str):
        raise InvalidInput("name: must be a string.", fields={"name": "Must be a string."})
    if "\x00" in name or any(ord(c) < 32 and c not in "\t" for c in name):
        raise InvalidInput("name: control characters are not allowed.", fields={"name": "Control characters."})
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInput(
            f"name: at most {MAX_NAME_LENGTH} characters.", fields={"name": f"At most {MAX_NAME_LENGTH} characters."}
        )
    return name.strip()


def _raise_if(errors: dict[str, str]) -> None:
    if errors:
        first = next(iter(errors))
        raise InvalidInput(f"{first}: {errors[first]}", fields=errors)


def _bookable_node_count(pool: Pool) -> int:
    annotated = getattr(pool, "bookable_nodes", None)  # read with the pool by selectors.pools_for_booking()
    return annotated if annotated is not None else pool.nodes.exclude(state=NodeState.RETIRED).count()


def _judge_role(role: str | None, *, roles: frozenset[str], actor: Any = None, owner_id: int | None = None) -> None:
    """Refuse a role outside roles, and a member acting on a booking owner_id made by someone else."""
    if role is None or role not in roles:
        raise PermissionDenied("Your role in this tenant does not allow that.")
    if owner_id is not None and role == Role.MEMBER and owner_id != actor.pk:
        raise PermissionDenied("Members can change only their own reservations; ask a lead.")


def _require_role(*, actor: Any, tenant: Tenant, roles: frozenset[str]) -> str:
    if getattr(actor, "is_staff", False):
        return "staff"
    role = role_of(user=actor, tenant=tenant)
    _judge_role(role, roles=roles)
    return role


def _can_change(*, actor: Any, reservation: Reservation) -> None:
    if getattr(actor, "is_staff", False):
        return
    _judge_role(role_of(user=actor, tenant=reservation.tenant), roles=BOOKING_ROLES, actor=actor,
                owner_id=reservation.created_by_id)


def request_fingerprint(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


# --- quota ------------------------------------------------------------------------------


# The same statement share-locks the pool row (FOR KEY SHARE, which bookings never contend for among
# themselves; their allocation inserts take it anyway) and reads its slot length: a slot-length change
# (pool_update locks the row FOR UPDATE) either waits for this booking's commit and then sees it as an
# open booking, or has committed and the booking is judged on the new grid here — never one validated
# against the old grid written into a pool that has just switched to another.
_QUOTA_LOCK_SQL = (
    "SELECT q.max_nodes, q.burst_nodes, q.max_duration_hours, p.slot_minutes FROM tenants_quota q"
    " JOIN reservations_pool p ON p.id = q.pool_id"
    " WHERE q.tenant_id = %(tenant)s AND q.pool_id = %(pool)s FOR NO KEY UPDATE OF q FOR KEY SHARE OF p"
)
# Read after the quota lock, so on a snapshot taken after any wait for it: the tenant's burst flag
# and the actor's role as they are now. The membership row is share-locked: a removal or downgrade
# either waits for this booking's commit or is seen here (the membership services never take the
# quota lock, so they cannot deadlock with a booker). The tenant row is key-share locked, the lock the
# reservation's foreign key takes at commit anyway (so no new contention): a change of the burst flag
# (tenant_update locks the row FOR UPDATE) in flight is waited for and read, and one that comes later
# waits for this booking's commit; without it a booking read the old flag, queued at its commit on
# the change's lock, and committed as burst after burst was disabled. Services that update the tenant
# row for other fields lock it FOR NO KEY UPDATE, which does not conflict.
# The same statement reads the tenant's peak use of the pool over the window (selectors.tenant_peak_usage): its
# snapshot is taken after the quota lock was granted (the statement before), so every booking of the tenant
# in the pool that held the lock before this one is counted — the only order the peak depends on.
# Constant fragments only, no input.
_RIGHTS_SQL = (
    f"SELECT t.burst_enabled, m.role, {selectors.PEAK_ONE_POOL_SCALAR} FROM tenants_tenant t"  # noqa: S608
    " JOIN tenants_membership m ON m.tenant_id = t.id AND m.user_id = %(actor)s WHERE t.id = %(tenant)s"
    " FOR SHARE OF m FOR KEY SHARE OF t"
)
_BURST_SQL = (f"SELECT burst_enabled, 'staff', {selectors.PEAK_ONE_POOL_SCALAR} FROM tenants_tenant"  # noqa: S608
              " WHERE id = %(tenant)s FOR KEY SHARE")


def _rights_and_peak(
    *, actor: Any, tenant: Tenant, pool: Pool, start: datetime, end: datetime, exclude_reservation_id: int | None,
    owner_id: int | None,
) -> tuple[bool, int]:
    """Check the actor may still book (or change owner_id's booking) for tenant; return its burst flag and the
    tenant's peak use of pool over [start, end) (exclude_reservation_id left out). Call after the quota lock."""
    params = selectors.peak_params(tenant_id=tenant.pk, pool_id=pool.pk, start=start, end=end,
                                   exclude_reservation_id=exclude_reservation_id)
    staff = actor is None or getattr(actor, "is_staff", False)
    with connection.cursor() as cur:
        cur.execute(_BURST_SQL if staff else _RIGHTS_SQL, {**params, "actor": _actor_id(actor)})
        row = cur.fetchone()
    if not staff:
        _judge_role(row and row[1], roles=BOOKING_ROLES, actor=actor, owner_id=owner_id)
    return bool(row[0]), int(row[2])


def _classify_billing(
    *, actor: Any, tenant: Tenant, pool: Pool, node_count: int, start: datetime, end: datetime,
    exclude_reservation_id: int | None = None, owner_id: int | None = None,
) -> tuple[str, int]:
    """Lock the quota row and decide committed vs burst, or refuse; with how many of the nodes are burst
    (above the guarantee at the peak, as the booking preview counts them).

    The row lock serialises one tenant's bookings in one pool, so two concurrent requests
    can never both see the same headroom (check-then-write race).
    """
    # FOR NO KEY UPDATE of this one row only: that lock on the tenant or pool row (Quota's default
    # ordering joins both) would serialise every booking of the pool; the pool row is only key-shared.
    # Plain numbers out — this statement runs on every booking.
    with connection.cursor() as cur:
        cur.execute(_QUOTA_LOCK_SQL, {"tenant": tenant.pk, "pool": pool.pk})
        row = cur.fetchone()
    if row is None:
        raise QuotaExceeded(f"Tenant {tenant.slug} has no quota for pool {pool.name}.")
    max_nodes, burst_nodes, max_duration_hours, slot_minutes = row
    if slot_minutes != pool.slot_minutes:  # changed since the window was checked: judge it on the grid now
        _raise_if(_grid_errors(start=start, end=end, slot_minutes=slot_minutes))
    burst_enabled, peak = _rights_and_peak(actor=actor, tenant=tenant, pool=pool, start=start, end=end,
                                           exclude_reservation_id=exclude_reservation_id, owner_id=owner_id)
    return _judge_quota(tenant=tenant, pool=pool, node_count=node_count, start=start, end=end, max_nodes=max_nodes,
                        burst_nodes=burst_nodes, max_duration_hours=max_duration_hours, burst_enabled=burst_enabled,
                        peak=peak)


def _judge_quota(
    *, tenant: Tenant, pool: Pool, node_count: int, start: datetime, end: datetime, max_nodes: int, burst_nodes: int,
    max_duration_hours: int | None, burst_enabled: bool, peak: int,
) -> tuple[str, int]:
    """Committed or burst, with how many of the nodes are burst, for node_count more nodes on top of the tenant's
    peak under its quota; or refuse (QuotaExceeded). The booking statement (BOOK_FUNCTION) judges by the same
    rule in SQL, and says which numbers refused it: this raises the refusal's words."""
    hours = (end - start).total_seconds() / 3600
    if max_duration_hours is not None and hours > max_duration_hours:
        raise QuotaExceeded(f"{hours:g} h is longer than the {max_duration_hours} h allowed in {pool.name}.")
    if peak + node_count <= max_nodes:
        return Billing.COMMITTED, 0
    limit = max_nodes + (burst_nodes if burst_enabled else 0)
    if peak + node_count <= limit:
        return Billing.BURST, min(node_count, peak + node_count - max_nodes)
    # The burst part only where there is one; "already holds up to 0 nodes" only where something is held.
    parts = f" ({max_nodes} guaranteed + {burst_nodes} burst)." if burst_enabled and burst_nodes else "."
    if peak == 0:
        raise QuotaExceeded(f"{count_of(node_count, f'{pool.name} node')} exceed{'s' if node_count == 1 else ''} "
                            f"{tenant.slug}'s limit of {limit}{parts}")
    raise QuotaExceeded(
        f"{tenant.slug} already holds up to {count_of(peak, f'{pool.name} node')} in that window; "
        f"{node_count} more exceeds the limit of {limit}{parts}"
    )


# --- node choice ------------------------------------------------------------------------


def _capacity_error(
    *, pool: Pool, node_count: int, start: datetime, end: datetime, now: datetime
) -> CapacityUnavailable:
    free = len(selectors.free_node_ids(pool_id=pool.pk, start=start, end=end, limit=node_count))
    suggestions = selectors.suggest_windows(
        pool=pool,
        node_count=node_count,
        start=start,
        end=end,
        earliest=slot_floor(now, pool.slot_minutes),
        latest_end=now + timedelta(days=settings.PORTAL_BOOKING_HORIZON_DAYS),
        search=timedelta(days=settings.PORTAL_SUGGESTION_SEARCH_DAYS),
    )
    total = pool.nodes.filter(state=NodeState.AVAILABLE).count()
    shortfall = {"free": free, "total": total, "pool_name": pool.name, "node_count": node_count, "start": start,
                 "end": end}
    error = CapacityUnavailable(
        capacity_text(**shortfall),
        suggestions=[{"start": format_utc(s["start"]), "end": format_utc(s["end"])} for s in suggestions],
    )
    # The parts, so a page can say the same in the reader's own zone (the API's text is in UTC).
    error.shortfall = shortfall
    return error


def capacity_text(
    *, free: int, total: int, pool_name: str, node_count: int, start: datetime, end: datetime, tz: Any = None,
) -> str:
    """Why a booking did not fit, with the window in UTC as the API has it (tz None), or for a page in tz
    as the pages write times ("Fri 11 Dec 09:00 CET", the templates' |when)."""
    if tz is None:
        window = f"from {start:%Y-%m-%d %H:%M}Z to {end:%Y-%m-%d %H:%M}Z"
    else:
        lo, hi = timezone.localtime(start, tz), timezone.localtime(end, tz)
        window = f"from {date_format(lo, PAGE_TIME_FORMAT)} to {date_format(hi, PAGE_TIME_FORMAT)}"
    return f"Only {free} of {total} available {pool_name} nodes are free {window}; {node_count} requested."


# Two bookings that insert the same node at the same time each find the other's uncommitted row
# in the exclusion index and wait for each other: PostgreSQL breaks that deadlock only after
# deadlock_timeout (1 s) and fails one with 40P01 — a second lost per collision, and retries spent
# (a race of 24 bookers on 4 nodes saw 136 of them). So a booking first takes a transaction
# advisory lock per node, in node-id order: a second booker of a node waits for the first to
# commit, then its insert fails at once with 23P01 and it picks again. Keys wrap at 2^31 (two
# nodes 2^31 ids apart only wait for each other). Namespace 72002: provisioning.constants.LOCK_BOOKING_NODE
# lists it with the app's other advisory-lock keys (a test checks the two agree).
_NODE_LOCKS = """
    SELECT count(pg_advisory_xact_lock(72002, (node_id %% 2147483648)::int)) AS locked
    FROM (SELECT node_id FROM unnest(%(nodes)s::bigint[]) AS node_id ORDER BY node_id) AS ordered
"""

# A node's state changes under the same lock (node_update), so once a booking holds its nodes'
# locks, a statement it starts afterwards (READ COMMITTED: a fresh snapshot) sees their state as
# final until it commits: a node drained meanwhile is never handed over, and a drain that comes
# later waits for the booking and then moves it off the node (node_replace_allocations). The
# writes below therefore run only when every chosen node is still available; a row from `ready`
# says so.
_READY = """
    SELECT 1 AS ok FROM reservations_node WHERE id = ANY(%(nodes)s::bigint[]) AND state = 'available'
    HAVING count(*) = cardinality(%(nodes)s::bigint[])
"""

# One INSERT of a booking's allocations in node-id order; {reservation} is the reservation id's
# SQL and {rows} what the SELECT reads besides the node ids. The period is passed as its two bounds
# (a half-open tstzrange is built by PostgreSQL): psycopg dumps a Python range in Python, a timestamp in C.
_ALLOCATIONS_INSERT = """
    INSERT INTO reservations_allocation (reservation_id, node_id, period, kind, active, note, created_by_id, created_at)
    SELECT {reservation}, node_id, tstzrange(%(lower)s, %(upper)s), %(kind)s, true, '', %(actor)s, %(now)s
    FROM {rows}unnest(%(nodes)s::bigint[]) AS node_id ORDER BY node_id
"""

# The booking's writes in one statement, after its node locks: the reservation row if the nodes
# are ready, then (reading its id) its allocations. A node won by a concurrent booking fails the
# whole statement with 23P01 (exclusion constraint); a node taken out of service returns no row.
_INSERT_BOOKING_TEMPLATE = """
    WITH ready AS ({ready}), r AS (
        INSERT INTO reservations_reservation (tenant_id, pool_id, node_count, period, name, status, status_reason,
            missing_nodes, billing, burst_part_nodes, orchestrator, cuda_version, created_by_id, created_at,
            updated_at)
        SELECT %(tenant)s, %(pool)s, %(n)s, tstzrange(%(lower)s, %(upper)s), %(name)s, %(status)s, '', 0, %(billing)s,
            %(burst_part)s, %(orchestrator)s, %(cuda)s, %(actor)s, %(now)s, %(now)s
        FROM ready
        RETURNING id, on_demand_rate, gpus_per_node
    ), a AS ({allocations})
    SELECT id, on_demand_rate, gpus_per_node FROM r
"""
# Constant fragments only, no input.
_INSERT_BOOKING_SQL = _INSERT_BOOKING_TEMPLATE.format(
    ready=_READY, allocations=_ALLOCATIONS_INSERT.format(reservation="r.id", rows="r, "))

_ALLOCATE_SQL = "WITH ready AS ({ready}) {insert}".format(
    ready=_READY, insert=_ALLOCATIONS_INSERT.format(reservation="%(reservation)s", rows="ready, "))


def _actor_id(actor: Any) -> int | None:
    return getattr(actor, "pk", None)


# --- the booking statement --------------------------------------------------------------
#
# A new booking's decisions under its locks take one round trip: a PL/pgSQL function runs the statements above in
# the order the services run them — the quota lock (_QUOTA_LOCK_SQL), the rights and the peak (_RIGHTS_SQL, or
# _BURST_SQL for staff), the judgement (_judge_quota's rule), the pick (selectors.FREE_NODES_SQL), the node locks
# (_NODE_LOCKS), the writes if every node is still available (_INSERT_BOOKING_SQL), then the audit row and the
# event's outbox row. Each is a statement of its own inside the function, so under READ COMMITTED each still takes
# a fresh snapshot after the locks before it, as it did when Python sent them one by one. The function is written
# from those constants (their %(name)s parameters become the function's arguments and variables), so they stay
# the one text of each statement; its name carries a hash of its definition, and a migrate (post_migrate, as
# Django keeps content types) creates it: code of one release never calls another release's function. A refusal
# comes back as an outcome with the numbers that decided it, for the Python to word (_judge_quota,
# _capacity_error). A node won by a concurrent booking raises 23P01 out of the function, as out of the insert.

_BOOK_NAMES = {
    "tenant": "p_tenant", "pool": "p_pool", "actor": "p_actor", "n": "p_n", "lower": "p_lower", "upper": "p_upper",
    "start": "p_lower", "end": "p_upper", "name": "p_name", "orchestrator": "p_orchestrator", "cuda": "p_cuda",
    "now": "p_now", "statuses": "p_statuses", "exclude": "0", "limit": "p_n", "nodes": "v_nodes",
    "billing": "o_billing", "burst_part": "o_burst_part",
    "available": f"'{NodeState.AVAILABLE}'", "status": f"'{ReservationStatus.CONFIRMED}'",
    "kind": f"'{AllocationKind.RESERVATION}'",
}


def _plpgsql(sql: str) -> str:
    """A services statement with its %(name)s parameters as the booking function's names (_BOOK_NAMES)."""
    def name(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        return _BOOK_NAMES[match.group(1)]  # a parameter the function does not know: KeyError at import
    return re.sub(r"%%|%\((\w+)\)s", name, sql).strip()


_BOOK_BODY = f"""
DECLARE
    v_role text;
    v_nodes bigint[];
    v_limit bigint;  -- bigint arithmetic, as Python's: a quota saved before today's limits holds up to 2^31-1
BEGIN
    {_plpgsql(_QUOTA_LOCK_SQL)} INTO o_max_nodes, o_burst_nodes, o_max_hours, o_slot_minutes;
    IF NOT FOUND THEN
        o_outcome := 'no_quota';
        RETURN;
    END IF;
    IF o_slot_minutes <> p_slot_minutes AND (mod(extract(epoch FROM p_lower), o_slot_minutes * 60) <> 0
                                             OR mod(extract(epoch FROM p_upper), o_slot_minutes * 60) <> 0) THEN
        o_outcome := 'grid';
        RETURN;
    END IF;
    IF p_staff THEN
        {_plpgsql(_BURST_SQL)} INTO o_burst_enabled, v_role, o_peak;
    ELSE
        {_plpgsql(_RIGHTS_SQL)} INTO o_burst_enabled, v_role, o_peak;
        IF v_role IS NULL OR NOT v_role = ANY(p_roles) THEN
            o_outcome := 'forbidden';
            RETURN;
        END IF;
    END IF;
    IF o_max_hours IS NOT NULL AND extract(epoch FROM p_upper - p_lower) > o_max_hours::bigint * 3600 THEN
        o_outcome := 'quota';
        RETURN;
    END IF;
    v_limit := o_max_nodes::bigint + CASE WHEN o_burst_enabled THEN o_burst_nodes ELSE 0 END;
    IF o_peak::bigint + p_n <= o_max_nodes THEN
        o_billing := '{Billing.COMMITTED}';
        o_burst_part := 0;
    ELSIF o_peak::bigint + p_n <= v_limit THEN
        o_billing := '{Billing.BURST}';
        o_burst_part := least(p_n, o_peak + p_n - o_max_nodes);
    ELSE
        o_outcome := 'quota';
        RETURN;
    END IF;
    SELECT array_agg(f.id ORDER BY f.id), array_agg(f.hostname ORDER BY f.id) INTO v_nodes, o_hostnames
    FROM ({_plpgsql(selectors.FREE_NODES_SQL)}) AS f;
    IF coalesce(cardinality(v_nodes), 0) < p_n THEN
        o_outcome := 'capacity';
        RETURN;
    END IF;
    PERFORM {_plpgsql(_NODE_LOCKS).removeprefix("SELECT ")};
    {_plpgsql(_INSERT_BOOKING_SQL)} INTO o_id, o_rate, o_gpus_per_node;
    IF NOT FOUND THEN
        o_outcome := 'node_taken';
        RETURN;
    END IF;
    -- Stamped as audit_record stamps its rows: the clock as the row is written, after any wait for the locks.
    INSERT INTO core_auditlog (created_at, actor_id, action, object_type, object_id, tenant_id, before, after)
    VALUES (clock_timestamp(), p_actor, 'reservation.create', 'reservations.reservation', o_id::text, p_tenant,
            '{{}}', p_audit || jsonb_build_object('billing', o_billing));
    IF p_event IS NOT NULL THEN
        INSERT INTO core_outboxevent (event, payload, created_at, available_at, attempts)
        VALUES (p_event, jsonb_build_object('reservation_id', o_id, 'tenant_id', p_tenant), clock_timestamp(),
                clock_timestamp(), 0)
        RETURNING id INTO o_outbox_id;
    END IF;
    o_outcome := 'booked';
END
"""  # noqa: S608 - constant fragments only, no input
_BOOK_SIGNATURE = """(
    p_tenant bigint, p_pool bigint, p_actor integer, p_staff boolean, p_roles text[], p_n integer,
    p_lower timestamptz, p_upper timestamptz, p_slot_minutes integer, p_name text, p_orchestrator text, p_cuda text,
    p_now timestamptz, p_statuses text[], p_audit jsonb, p_event text,
    OUT o_outcome text, OUT o_id bigint, OUT o_rate numeric, OUT o_gpus_per_node integer, OUT o_billing text,
    OUT o_burst_part integer, OUT o_hostnames text[], OUT o_outbox_id bigint, OUT o_max_nodes integer,
    OUT o_burst_nodes integer, OUT o_max_hours integer, OUT o_slot_minutes integer, OUT o_burst_enabled boolean,
    OUT o_peak integer)"""
# The function's plans: each statement is planned once per connection (a generic plan, not planned again at every
# call as PostgreSQL's default may settle on), and through its indexes. A plan is kept until the statistics of its
# tables change, so one made while the tables were nearly empty (a fresh deployment, statistics taken just after a
# clean-up) would otherwise scan every allocation of the fleet at each booking: in bench/booking.py, one run in two
# spent 2-3 ms more PostgreSQL CPU per booking that way (bench/RESULTS.md, session 19). Every statement here has an
# index for what it looks up (tests/test_booking_statement.py reads the counters). The setting also covers the
# triggers the function's inserts fire; the deferred foreign-key checks run at the commit, outside it.
_BOOK_OPTIONS = "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off"
BOOK_FUNCTION = "reservations_book_" + hashlib.sha256(
    (_BOOK_SIGNATURE + _BOOK_OPTIONS + _BOOK_BODY).encode()).hexdigest()[:12]
BOOK_FUNCTION_SQL = (f"CREATE OR REPLACE FUNCTION {BOOK_FUNCTION}{_BOOK_SIGNATURE} LANGUAGE plpgsql VOLATILE"
                     f" {_BOOK_OPTIONS} AS $book$ {_BOOK_BODY} $book$")
_BOOK_CALL = (
    f"SELECT * FROM {BOOK_FUNCTION}(%(tenant)s, %(pool)s, %(actor)s, %(staff)s, %(roles)s, %(n)s, %(lower)s,"  # noqa: S608
    " %(upper)s, %(slot_minutes)s, %(name)s, %(orchestrator)s, %(cuda)s, %(now)s, %(statuses)s, %(audit)s::jsonb,"
    " %(event)s)"
)


def install_booking_function(using: str = "default") -> None:
    """Create this release's booking function (BOOK_FUNCTION) unless the database has it (post_migrate)."""
    from django.db import connections

    # Under a lock of its own name: two processes creating it at once (bookers meeting it missing, a migrate) would
    # otherwise both write its catalog row ("tuple concurrently updated").
    with transaction.atomic(using=using), connections[using].cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [BOOK_FUNCTION])
        cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", [BOOK_FUNCTION])
        if cur.fetchone() is None:
            cur.execute(BOOK_FUNCTION_SQL)


def _book_statement(
    *, actor: Any, tenant: Tenant, pool: Pool, node_count: int, start: datetime, end: datetime, name: str,
    orchestrator: str, cuda_version: str,
) -> Reservation:
    """Book in one statement (BOOK_FUNCTION): the confirmed reservation holding its nodes, its audit row and its
    event, or the refusal raised as the services raise it. Raises _NodeTaken when a chosen node left the available
    state before its lock was ours, and 23P01 (IntegrityError) when a concurrent booking won one."""
    now = timezone.now()
    staff = actor is None or getattr(actor, "is_staff", False)
    event = "reservation.confirmed"
    audit = {"start": format_utc(start), "end": format_utc(end), "node_count": node_count,
             "status": ReservationStatus.CONFIRMED, "name": name}
    with connection.cursor() as cur:
        cur.execute(_BOOK_CALL, {
            "tenant": tenant.pk, "pool": pool.pk, "actor": _actor_id(actor), "staff": staff,
            "roles": sorted(BOOKING_ROLES), "n": node_count, "lower": start, "upper": end,
            "slot_minutes": pool.slot_minutes, "name": name, "orchestrator": orchestrator, "cuda": cuda_version,
            "now": now, "statuses": list(selectors.HOLDING_STATUSES), "audit": json.dumps(audit),
            "event": event if events.outbox_wanted(event) else None,
        })
        (outcome, reservation_id, rate, gpus_per_node, billing, burst_part, hostnames, outbox_id, max_nodes,
         burst_nodes, max_hours, slot_minutes, burst_enabled, peak) = cur.fetchone()
    if outcome == "no_quota":
        raise QuotaExceeded(f"Tenant {tenant.slug} has no quota for pool {pool.name}.")
    if outcome == "grid":  # the pool's slot changed since the window was checked: judged on the grid now
        _raise_if(_grid_errors(start=start, end=end, slot_minutes=slot_minutes))
    if outcome == "forbidden":
        _judge_role(None, roles=BOOKING_ROLES)
    if outcome == "quota":
        _judge_quota(tenant=tenant, pool=pool, node_count=node_count, start=start, end=end, max_nodes=max_nodes,
                     burst_nodes=burst_nodes, max_duration_hours=max_hours, burst_enabled=burst_enabled, peak=peak)
    if outcome == "capacity":
        raise _capacity_error(pool=pool, node_count=node_count, start=start, end=end, now=now)
    if outcome == "node_taken":
        raise _NodeTaken(sorted(hostnames))
    if outcome != "booked":
        raise RuntimeError(f"booking statement answered {outcome!r}")  # a judgement above that let it through
    period = DateTimeTZRange(start, end, "[)")
    reservation = Reservation(
        id=reservation_id, tenant=tenant, pool=pool, node_count=node_count, period=period, name=name,
        status=ReservationStatus.CONFIRMED, billing=billing, burst_part_nodes=burst_part, on_demand_rate=rate,
        gpus_per_node=gpus_per_node, orchestrator=orchestrator, cuda_version=cuda_version,
        created_by=actor if _actor_id(actor) else None, created_at=now, updated_at=now,
    )
    reservation._state.adding = False
    reservation._state.db = connection.alias
    # Handed to the caller so the response needs no second read of what was just written.
    reservation.node_hostnames = sorted(hostnames)
    events.announce(event, {"reservation_id": reservation_id, "tenant_id": tenant.pk}, outbox_id)
    return reservation


def _lock_pools(pool_ids: set[int]) -> dict[int, int]:
    """Key-share lock the pools (id order), as a booking does with its quota lock, so a slot-length change
    (pool_update: FOR UPDATE) waits for the caller's commit or is waited for; return each one's slot length."""
    with connection.cursor() as cur:
        cur.execute("SELECT id, slot_minutes FROM reservations_pool WHERE id = ANY(%s) ORDER BY id FOR KEY SHARE",
                    [sorted(pool_ids)])
        return dict(cur.fetchall())


def _lock_nodes(node_ids: list[int]) -> None:
    """Take the booking locks of node_ids (in id order) before moving allocations onto a new period."""
    with connection.cursor() as cur:
        cur.execute(_NODE_LOCKS, {"nodes": sorted(node_ids)})


def _allocate(*, reservation: Reservation, node_ids: list[int], period: DateTimeTZRange, actor: Any) -> None:
    """Allocate node_ids to reservation for period, in node-id order (their locks, then one insert).

    Raises _NodeTaken when one of the nodes left the available state before its lock was ours.
    """
    nodes = sorted(node_ids)
    with connection.cursor() as cur:
        cur.execute(_NODE_LOCKS, {"nodes": nodes})
        cur.execute(_ALLOCATE_SQL, {"reservation": reservation.pk, "lower": period.lower, "upper": period.upper,
                                    "kind": AllocationKind.RESERVATION,
                                    "actor": _actor_id(actor), "now": timezone.now(), "nodes": nodes})
        if cur.rowcount != len(nodes):
            raise _NodeTaken(nodes)


def _with_retry(attempt_fn, *, on_exhausted):
    """Run attempt_fn in a savepoint, again when a concurrent booking won the same node (23P01) or it left
    service; any other error (a deadlock, 40P01, included: see _lost_node) goes up to the caller's loop."""
    for attempt in range(settings.PORTAL_BOOKING_MAX_ATTEMPTS):
        try:
            with transaction.atomic():
                return attempt_fn()
        except _RETRYABLE as exc:
            if not _lost_node(exc):
                raise
            logger.info("booking collided with a concurrent change (attempt %d): %r", attempt + 1, exc)
    raise on_exhausted()


def _rerun_while_transient(what: str, run_once: Callable[[], _T]) -> _T:
    """run_once (a durable transaction of its own) again on a fresh snapshot when PostgreSQL rolled it back over a
    concurrent transaction (a deadlock, a serialization failure), at most PORTAL_BOOKING_MAX_ATTEMPTS times; then
    Busy (503, nothing written). Any other error goes up at once."""
    for attempt in range(settings.PORTAL_BOOKING_MAX_ATTEMPTS):
        try:
            return run_once()
        except OperationalError as exc:
            if not is_transient(exc):
                raise
            logger.info("%s lost to a concurrent change (attempt %d): %r", what, attempt + 1, exc)
    raise Busy()


# --- reservations -----------------------------------------------------------------------


def reservation_create(
    *,
    actor: Any,
    tenant: Tenant,
    pool: Pool,
    node_count: int,
    start: datetime,
    end: datetime,
    name: str = "",
    orchestrator: str = Orchestrator.SLURM,
    cuda_version: str = DEFAULT_CUDA_VERSION,
    idempotency_key: str | None = None,
    request_hash: str = "",
) -> Reservation:
    """Book node_count dedicated nodes of pool for [start, end) for tenant (DESIGN §4).

    A request refused as invalid that an idempotency_key already booked gets that booking back: a
    retry must not be refused for what changed since (the slot it started in has passed, the pool
    lost a node) while its booking holds the nodes.
    """
    _require_role(actor=actor, tenant=tenant, roles=BOOKING_ROLES)
    if idempotency_key:
        _validate_idempotency_key(idempotency_key)
    now = timezone.now()
    try:
        name = _validate_name(name)
        errors = _validate_window(pool=pool, start=start, end=end, now=now)
        if not isinstance(node_count, int) or isinstance(node_count, bool) or node_count < 1:
            errors["node_count"] = "Must be a whole number of at least 1."
        elif node_count > (bookable := _bookable_node_count(pool)):
            errors["node_count"] = f"The {pool.name} pool has only {bookable} nodes."
        if orchestrator not in Orchestrator.values:
            errors["cluster.orchestrator"] = f"One of {', '.join(Orchestrator.values)}."
        if cuda_version not in CUDA_VERSIONS:
            errors["cluster.cuda_version"] = f"One of {', '.join(CUDA_VERSIONS)}."
        _raise_if(errors)
    except InvalidInput:
        replay = _idempotency_replay(user=actor, key=idempotency_key, request_hash=request_hash)
        if replay is None:
            raise
        return replay

    # A concurrent booking that won one of our nodes aborts our transaction with 23P01 (its
    # insert committed first); the whole booking is then retried from the quota lock on, on a
    # fresh snapshot. The common, uncontended case pays for no savepoints. So is one PostgreSQL
    # rolled back over a concurrent transaction (a deadlock, a serialization failure). Attempts
    # used up: capacity_unavailable only if the last one lost a node (the pick finding too few
    # says so itself); lost to deadlocks, nothing says the nodes are taken: Busy (503, nothing written).
    lost_node = False
    for attempt in range(settings.PORTAL_BOOKING_MAX_ATTEMPTS):
        try:
            return _book_once(
                actor=actor, tenant=tenant, pool=pool, node_count=node_count, start=start, end=end, name=name,
                orchestrator=orchestrator, cuda_version=cuda_version, idempotency_key=idempotency_key,
                request_hash=request_hash, now=now,
            )
        except _RETRYABLE as exc:
            if not _lost_race(exc):
                raise
            lost_node = _lost_node(exc)
            logger.info("booking collided with a concurrent change (attempt %d): %r", attempt + 1, exc)
    if not lost_node:
        raise Busy()
    raise _capacity_error(pool=pool, node_count=node_count, start=start, end=end, now=now)


def _book_once(**attempt: Any) -> Reservation:
    """One attempt (_book_attempt). A database this release's migrate has not run on yet (its migrations all
    applied by an earlier release, so no migrate was called for) lacks this release's booking function: it is
    created here and the attempt, rolled back whole, runs again. Not inside a caller's transaction, which the
    missing function has aborted."""
    try:
        return _book_attempt(**attempt)
    except ProgrammingError as exc:
        if _sqlstate(exc) != UNDEFINED_FUNCTION or connection.in_atomic_block or BOOK_FUNCTION not in str(exc):
            raise
        logger.warning("booking function %s missing (no migrate since this release): creating it", BOOK_FUNCTION)
        install_booking_function(connection.alias)
    return _book_attempt(**attempt)


def _book_attempt(
    *, actor: Any, tenant: Tenant, pool: Pool, node_count: int, start: datetime, end: datetime, name: str,
    orchestrator: str, cuda_version: str, idempotency_key: str | None, request_hash: str, now: datetime,
) -> Reservation:
    book = {"actor": actor, "tenant": tenant, "pool": pool, "node_count": node_count, "start": start, "end": end,
            "name": name, "orchestrator": orchestrator, "cuda_version": cuda_version}
    if not idempotency_key and not connection.in_atomic_block:
        return _book_statement(**book)  # one statement: its own transaction
    # With a key, its claim and the booking commit together. Inside a caller's atomic block (a test's), the
    # durable block is a savepoint that a lost race rolls back to, as the transaction is outside one.
    with transaction.atomic(durable=True):
        if idempotency_key:
            replay = _claim_idempotency_key(user=actor, key=idempotency_key, request_hash=request_hash)
            if replay is not None:
                return replay
        reservation = _book_statement(**book)
        if idempotency_key:
            IdempotencyKey.objects.filter(user=actor, key=idempotency_key).update(reservation=reservation)
    return reservation


def _validate_idempotency_key(key: str) -> None:
    """The key is stored as text: at most 255 characters, and no NUL (PostgreSQL text cannot hold one)."""
    if len(key) > 255:
        raise InvalidInput("Idempotency-Key: at most 255 characters.", fields={"Idempotency-Key": "Too long."})
    if "\x00" in key:
        raise InvalidInput("Idempotency-Key: must not contain NUL characters.",
                           fields={"Idempotency-Key": "Must not contain NUL characters."})


def _idempotency_replay(*, user: Any, key: str | None, request_hash: str) -> Reservation | None:
    """The booking the same request under (user, key) made within the TTL, else None (no key, another
    request under it, or one still in flight: those are judged as any request is)."""
    if not key:
        return None
    ttl = timedelta(hours=settings.PORTAL_IDEMPOTENCY_KEY_TTL_HOURS)
    existing = (IdempotencyKey.objects.select_related("reservation")
                .filter(user=user, key=key, request_hash=request_hash, reservation__isnull=False,
                        created_at__gte=timezone.now() - ttl)
                .first())
    if existing is None:
        return None
    reservation = existing.reservation
    reservation._replayed = True
    return reservation


def _claim_idempotency_key(*, user: Any, key: str, request_hash: str) -> Reservation | None:
    """Claim (user, key) or return the reservation it already made.

    The unique index makes a concurrent twin wait for our commit; it then sees the row and
    replays our result instead of booking again. If we roll back, the twin books itself.
    A key past PORTAL_IDEMPOTENCY_KEY_TTL_HOURS is claimed afresh, whether or not the hourly
    prune has taken it yet: it replays for the TTL, not until the next prune. ON CONFLICT
    locks the key it meets either way, so the prune (SKIP LOCKED) cannot take it from under
    the read that follows.
    """
    ttl = timedelta(hours=settings.PORTAL_IDEMPOTENCY_KEY_TTL_HOURS)
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO reservations_idempotencykey (user_id, key, request_hash, created_at) "
            "VALUES (%s, %s, %s, now()) ON CONFLICT (user_id, key) DO UPDATE"
            " SET request_hash = EXCLUDED.request_hash, created_at = now(), reservation_id = NULL"
            " WHERE reservations_idempotencykey.created_at < now() - %s RETURNING id",
            [user.pk, key, request_hash, ttl],
        )
        if cur.fetchone() is not None:
            return None
    existing = IdempotencyKey.objects.select_related("reservation").get(user=user, key=key)
    if existing.request_hash != request_hash:
        raise InvalidInput(
            "Idempotency-Key was already used with a different request.",
            fields={"Idempotency-Key": "Reused with a different request body."},
        )
    reservation = existing.reservation
    reservation._replayed = True
    return reservation


def _snapshot(reservation: Reservation) -> dict[str, Any]:
    return {
        "start": format_utc(reservation.period.lower),
        "end": format_utc(reservation.period.upper),
        "node_count": reservation.node_count,
        "status": reservation.status,
        "billing": reservation.billing,
        "name": reservation.name,
    }


def _lock(reservation: Reservation) -> Reservation:
    return Reservation.objects.select_for_update(of=("self",)).select_related("tenant", "pool").get(pk=reservation.pk)


# Who else may refuse a window change: a higher app (DESIGN §2: reservations imports none) registers a rule
# here from its AppConfig.ready(), e.g. provisioning's "the tenant's clusters in that window hold more storage
# than its quota". Each is called with the reservation (row-locked, its period still the old one) and the new
# period, inside reservation_update's transaction after its node locks (a rule may take a lock of its own there,
# after them), and raises a DomainError to refuse: nothing of the change is written.
window_change_guards: list[Callable[[Reservation, DateTimeTZRange], None]] = []


def reservation_update(
    *, actor: Any, reservation: Reservation, start: datetime | None = None, end: datetime | None = None,
    name: str | None = None, expected: dict[str, Any] | None = None,
) -> Reservation:
    """Extend, shorten, move (before it begins) or rename, under the same rules as booking.

    expected ({"start"/"end"/"name": value}, what a page showed): refused (InvalidState, nothing written) if any
    of them is no longer so, checked under the row lock — a page's "+1 slot" made before someone else changed
    the end must not set an end the user never meant (an earlier one than the booking has by now).

    A transaction PostgreSQL rolls back to resolve a conflict with a concurrent one (a deadlock, e.g. with a
    booking of the same tenant over the tenant row lock a window guard takes, or a serialization failure) is run
    again from the row lock on, on a fresh snapshot, at most PORTAL_BOOKING_MAX_ATTEMPTS times; then Busy (503,
    nothing written)."""
    return _rerun_while_transient("reservation change", lambda: _update_once(
        actor=actor, reservation=reservation, start=start, end=end, name=name, expected=expected))


def _update_once(
    *, actor: Any, reservation: Reservation, start: datetime | None, end: datetime | None, name: str | None,
    expected: dict[str, Any] | None,
) -> Reservation:
    with transaction.atomic(durable=True):
        reservation = _lock(reservation)
        _can_change(actor=actor, reservation=reservation)
        shown_now = {"start": reservation.period.lower, "end": reservation.period.upper, "name": reservation.name}
        refuse_stale((k for k, v in (expected or {}).items() if k in shown_now and shown_now[k] != v),
                     by="someone else")
        if reservation.status in FINAL_STATUSES:
            raise InvalidState(f"Reservation #{reservation.pk} is {reservation.status}; it can no longer change.")
        if reservation.status == ReservationStatus.ENDING and (start is not None or end is not None):
            # Its cluster is being torn down: a longer window would hold nodes nothing runs on.
            raise InvalidState(f"Reservation #{reservation.pk} is ending (its cluster is being torn down); "
                               "its window can no longer change. Book again instead.")
        before = _snapshot(reservation)
        now = timezone.now()
        pool = reservation.pool
        old_start, old_end = reservation.period.lower, reservation.period.upper
        started = old_start <= now
        # Provisioning (ahead of its start): its cluster is being built, or waits built, on its nodes. Like a
        # running booking it keeps them — moving the start would free them in the gap and re-picking nodes
        # would leave the cluster on nodes others then book; only its end may change, on the same nodes.
        keeps_nodes = started or reservation.status == ReservationStatus.PROVISIONING
        new_start = old_start if start is None else start
        new_end = old_end if end is None else end
        if new_start != old_start and started:
            raise InvalidState("The reservation has begun; its start can no longer move.")
        if new_start != old_start and keeps_nodes:
            raise InvalidState(f"Reservation #{reservation.pk}'s cluster is being provisioned on its nodes; its "
                               "start can no longer move. Change its end, or cancel it and book again.")
        errors = _validate_window(pool=pool, start=new_start, end=new_end, now=now, allow_past_start=started)
        if not errors and new_end <= now:
            errors["end"] = "Cannot end in the past; cancel it instead."
        _raise_if(errors)
        if name is not None:
            reservation.name = _validate_name(name)

        if (new_start, new_end) != (old_start, old_end):
            if not (old_start <= new_start and new_end <= old_end):
                reservation.billing, reservation.burst_part_nodes = _classify_billing(
                    actor=actor, tenant=reservation.tenant, pool=pool, node_count=reservation.node_count,
                    start=new_start, end=new_end, exclude_reservation_id=reservation.pk,
                    owner_id=reservation.created_by_id,
                )
            elif reservation.billing == Billing.BURST:
                # A window inside the old one only gives nodes back: never refused (a quota lowered or
                # removed since must not stop a tenant from returning capacity early), but classified by
                # the same rule as a booking (DESIGN §4): committed once it fits the guarantee.
                reservation.billing, reservation.burst_part_nodes = _billing_after_shrink(
                    reservation=reservation, start=new_start, end=new_end)
            period = DateTimeTZRange(new_start, new_end, "[)")
            _repoint_allocations(reservation=reservation, period=period, started=keeps_nodes, now=now, actor=actor)
            for guard in window_change_guards:
                guard(reservation, period)
            reservation.period = period
        reservation.save()
        audit_record(actor=actor, action="reservation.update", obj=reservation, tenant_id=reservation.tenant_id,
                     before=before, after=_snapshot(reservation))
        events.emit("reservation.changed", reservation_id=reservation.pk, tenant_id=reservation.tenant_id)
    return reservation


def _billing_after_shrink(*, reservation: Reservation, start: datetime, end: datetime) -> tuple[str, int]:
    """Committed if the shrunk window fits the tenant's guarantee now, else burst with no more nodes above
    it than before (a quota lowered since must not raise the cost of giving capacity back)."""
    held = (reservation.billing, reservation.burst_part_nodes)
    with connection.cursor() as cur:
        cur.execute(_QUOTA_LOCK_SQL, {"tenant": reservation.tenant_id, "pool": reservation.pool_id})
        row = cur.fetchone()
    if row is None:
        return held
    peak = selectors.tenant_peak_usage(tenant_id=reservation.tenant_id, pool_id=reservation.pool_id, start=start,
                                       end=end, exclude_reservation_id=reservation.pk)
    over = peak + reservation.node_count - row[0]
    return (Billing.COMMITTED, 0) if over <= 0 else (held[0], min(held[1], over))


def _repoint_allocations(
    *, reservation: Reservation, period: DateTimeTZRange, started: bool, now: datetime, actor: Any
) -> None:
    """Move the reservation's allocations to period: same nodes if free, else (not yet begun, not provisioning:
    not started) other nodes."""
    allocations = reservation.allocations.filter(active=True)
    try:
        with transaction.atomic():
            _lock_nodes(list(allocations.values_list("node_id", flat=True)))  # as bookers of them do
            if started:
                # Its start cannot move; a spare taken after a node swap keeps holding from its cut on.
                with connection.cursor() as cur:
                    cur.execute("UPDATE reservations_allocation SET period = tstzrange(lower(period), %s, '[)')"
                                " WHERE reservation_id = %s AND active", [period.upper, reservation.pk])
            else:
                allocations.update(period=period)
            return
    except IntegrityError as exc:
        # Only 23P01 means one of its nodes is booked in the new window. A deadlock (40P01, an OperationalError)
        # is a race lost to a concurrent transaction, not a verdict on the nodes: it goes up, and
        # reservation_update runs the whole change again on a fresh snapshot.
        if _sqlstate(exc) != EXCLUSION_VIOLATION:
            raise
    pool, n = reservation.pool, reservation.node_count
    if started:
        busy = _conflicting_nodes(reservation=reservation, period=period)
        raise CapacityUnavailable(
            f"Cannot extend: {', '.join(busy) or 'its nodes'} are booked in the new window; "
            "a running or provisioning reservation keeps its nodes.",
            suggestions=[],
        )

    def attempt() -> None:
        # Only the allocations holding nodes: the released ones are the record of earlier node swaps (which
        # node, replaced when and why), read by staff on the booking's admin page; they hold nothing.
        allocations.delete()
        node_ids = selectors.free_node_ids(pool_id=pool.pk, start=period.lower, end=period.upper, limit=n)
        if len(node_ids) < n:
            raise _capacity_error(pool=pool, node_count=n, start=period.lower, end=period.upper, now=now)
        _allocate(reservation=reservation, node_ids=node_ids, period=period, actor=actor)
        reservation.missing_nodes = 0  # it holds node_count nodes again (saved by reservation_update)

    _with_retry(attempt, on_exhausted=lambda: _capacity_error(
        pool=pool, node_count=n, start=period.lower, end=period.upper, now=now))


def _conflicting_nodes(*, reservation: Reservation, period: DateTimeTZRange) -> list[str]:
    node_ids = reservation.allocations.values_list("node_id", flat=True)
    return sorted(
        Allocation.objects.filter(node_id__in=node_ids, active=True, period__overlap=period)
        .exclude(reservation=reservation)
        .values_list("node__hostname", flat=True)
        .distinct()
    )


def reservation_cancel(*, actor: Any, reservation: Reservation) -> Reservation:
    """Cancel; the nodes are free for others the moment this commits.

    Like reservation_update, a transaction PostgreSQL rolls back over a concurrent one (a deadlock, e.g. with a
    node swap moving its allocations, or a serialization failure) is run again from the row lock on, on a fresh
    snapshot, at most PORTAL_BOOKING_MAX_ATTEMPTS times; then Busy (503, nothing written)."""
    return _rerun_while_transient("reservation cancel", lambda: _cancel_once(actor=actor, reservation=reservation))


def _cancel_once(*, actor: Any, reservation: Reservation) -> Reservation:
    with transaction.atomic(durable=True):
        reservation = _lock(reservation)
        _can_change(actor=actor, reservation=reservation)
        if reservation.status in FINAL_STATUSES:
            raise InvalidState(f"Reservation #{reservation.pk} is already {reservation.status}.")
        if reservation.status == ReservationStatus.ENDING and reservation.period.upper <= timezone.now():
            # Its window is over and its teardown runs: it completes, it is not cancelled after the fact.
            raise InvalidState(f"Reservation #{reservation.pk} has ended; its cluster is being torn down.")
        before = _snapshot(reservation)
        reservation.status = ReservationStatus.CANCELLED
        reservation.status_reason = ""  # the last step's ("provisioning lead time reached") no longer applies
        reservation.cancelled_at = timezone.now()
        reservation.save(update_fields=["status", "status_reason", "cancelled_at", "updated_at"])
        reservation.allocations.filter(active=True).update(active=False)
        audit_record(actor=actor, action="reservation.cancel", obj=reservation, tenant_id=reservation.tenant_id,
                     before=before, after=_snapshot(reservation))
        events.emit("reservation.cancelled", reservation_id=reservation.pk, tenant_id=reservation.tenant_id)
    return reservation


def reservation_set_status(
    *, reservation_id: int, status: str, expected: tuple[str, ...], reason: str = "", actor: Any = None
) -> Reservation | None:
    """Move a reservation along its lifecycle if it is still in one of the expected states.

    Used by the lifecycle tasks: re-reads under a lock and does nothing when the state has
    already moved on, so a task that runs twice changes nothing the second time.
    """
    with transaction.atomic():
        reservation = Reservation.objects.select_for_update().filter(pk=reservation_id).first()
        if reservation is None or reservation.status not in expected:
            return None
        before = _snapshot(reservation)
        fields = ["status", "status_reason", "updated_at"]
        if status == ReservationStatus.FAILED and reservation.status == ReservationStatus.ENDING:
            # Its teardown failed: it ran, and held its nodes until now (usage counts that).
            reservation.released_at = timezone.now()
            fields.append("released_at")
        reservation.status = status
        reservation.status_reason = reason[:500]
        reservation.save(update_fields=fields)
        if status in (ReservationStatus.FAILED,):
            reservation.allocations.filter(active=True).update(active=False)
        audit_record(actor=actor, action=f"reservation.{status}", obj=reservation, tenant_id=reservation.tenant_id,
                     before=before, after=_snapshot(reservation))
        events.emit(f"reservation.{status}", reservation_id=reservation.pk, tenant_id=reservation.tenant_id)
    return reservation


# --- fleet (staff) ----------------------------------------------------------------------


def _create_unique(model: Any, field: str, *, constraint: str | None = None, **values: Any) -> Any:
    """model.objects.create(**values); a concurrent create of the same unique field (which the exists()
    check before it could not see) is the same 400 as a sequential one, not the IntegrityError's 500.
    constraint: a unique constraint over an expression of the field (lower(hostname)), which is the field's
    too."""
    try:
        with transaction.atomic():
            return model.objects.create(**values)
    except IntegrityError as exc:
        violated = getattr(getattr(exc.__cause__, "diag", None), "constraint_name", None)
        if f"({field})" not in str(exc) and (constraint is None or violated != constraint):
            raise
        raise InvalidInput(f"{field}: already in use.", fields={field: "Already in use."}) from exc


def slot_minutes_error(slot_minutes: Any) -> str | None:
    """Why a pool cannot have this slot length (the slots must tile a day), or None; the admin's form asks too."""
    if not isinstance(slot_minutes, int) or slot_minutes < 1 or 1440 % slot_minutes:
        return "Must divide 1440 (a day), e.g. 15, 30 or 60."
    return None


@transaction.atomic(durable=True)
def pool_create(*, actor: Any, name: str, gpu_model: str, gpus_per_node: int, slot_minutes: int = 60,
                on_demand_rate: Any = 0) -> Pool:
    if Pool.objects.filter(name=name).exists():
        raise InvalidInput("name: a pool with that name exists.", fields={"name": "Already in use."})
    if slot_minutes_error(slot_minutes):
        raise InvalidInput("slot_minutes: must divide a day.", fields={"slot_minutes": "Must divide 1440."})
    pool = _create_unique(Pool, "name", name=name, gpu_model=gpu_model, gpus_per_node=gpus_per_node,
                          slot_minutes=slot_minutes, on_demand_rate=on_demand_rate)
    audit_record(actor=actor, action="pool.create", obj=pool,
                 after={"name": name, "gpu_model": gpu_model, "gpus_per_node": gpus_per_node})
    return pool


# A hostname as the backends name nodes: Slurm node lists are comma-separated and scontrol lines split on spaces,
# so anything else (a comma, a space, a ';') would name other nodes or break the command the node is used in.
HOSTNAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$"
HOSTNAME_RULE = "Letters, digits, dots and hyphens only (at most 253), starting and ending with a letter or digit."


def hostname_error(hostname: Any) -> str | None:
    """Why a node cannot have this hostname, or None; the admin's form asks too."""
    if not isinstance(hostname, str) or not re.fullmatch(HOSTNAME_PATTERN, hostname):
        return HOSTNAME_RULE
    return None


@transaction.atomic(durable=True)
def node_create(*, actor: Any, hostname: str, pool: Pool, state: str = NodeState.AVAILABLE,
                gpus: list[dict[str, Any]] | None = None) -> Node:
    if hostname_error(hostname):
        raise InvalidInput(f"hostname: {HOSTNAME_RULE[0].lower()}{HOSTNAME_RULE[1:]}",
                           fields={"hostname": HOSTNAME_RULE})
    if Node.objects.filter(hostname__iexact=hostname).exists():  # one host in DNS terms (the database's too)
        raise InvalidInput("hostname: a node with that hostname exists.", fields={"hostname": "Already in use."})
    node = _create_unique(Node, "hostname", constraint="node_hostname_ci_unique", hostname=hostname, pool=pool,
                          state=state, gpus=gpus or [])
    audit_record(actor=actor, action="node.create", obj=node, after={"hostname": hostname, "pool": pool.name,
                                                                     "state": state})
    return node


# Who else may keep a node out of service: a higher app (DESIGN §2: reservations imports none) registers
# a rule here from its AppConfig.ready(), e.g. provisioning.health's "an open repair owns the node". Each is
# called with the node's id inside node_update's transaction, before the node's booking lock (a rule may
# take a lock of its own there, ahead of it), whenever a node is to become available, and returns why it
# may not now, or None. Whoever asks — staff through the API or the admin, or a worker — is refused alike;
# a repair gives its node back by closing first (rejoined), after which no rule objects.
node_return_blockers: list[Callable[[int], str | None]] = []


class _NodeLeftAvailable(Exception):
    """node_update skipped the return blockers for an available node that had left that state by its locks."""


def node_update(*, actor: Any, node: Node, state: str | None = None, reason: str | None = None,
                only_from: Collection[str] | None = None) -> Node:
    """Change a node's state; only available nodes are given to new bookings.

    A state change takes the node's booking lock first: it waits for a booking that is handing the
    node over (which then holds it, and a drain moves it off afterwards), and a booking that
    chose the node meanwhile waits for the change and then finds the node gone (_READY).
    Making a node available is refused (InvalidState) while a registered rule holds it out
    (node_return_blockers: an open health repair). A node already available is not asked about
    (the rules wait for a health step in flight on the node): a no-op or a reason edit does not
    queue; should the node have left available before its locks are ours, the change starts
    over and asks them.

    ``only_from``: a caller that decided on the state it read earlier (a health drain, a repair's
    step) names the states it may change; if someone else (staff) moved the node elsewhere before
    its locks were ours, nothing is written and the node comes back as it is now.
    """
    ask_blockers = state == NodeState.AVAILABLE and not Node.objects.filter(
        pk=node.pk, state=NodeState.AVAILABLE).exists()
    try:
        return _node_update(actor=actor, node=node, state=state, reason=reason, ask_blockers=ask_blockers,
                            only_from=only_from)
    except _NodeLeftAvailable:
        return _node_update(actor=actor, node=node, state=state, reason=reason, ask_blockers=True,
                            only_from=only_from)


def _node_update(*, actor: Any, node: Node, state: str | None, reason: str | None, ask_blockers: bool,
                 only_from: Collection[str] | None = None) -> Node:
    with transaction.atomic(durable=True):
        if ask_blockers:
            for blocker in node_return_blockers:
                why = blocker(node.pk)
                if why and Node.objects.filter(pk=node.pk).exclude(state=NodeState.AVAILABLE).exists():
                    raise InvalidState(f"{node.hostname} cannot be made available: {why}")
        if state is not None:
            _lock_nodes([node.pk])  # before the row lock, as bookers take them
        node = Node.objects.select_for_update().get(pk=node.pk)
        if only_from is not None and node.state not in only_from:
            return node  # moved on by someone else meanwhile: their change stands
        if state == NodeState.AVAILABLE and not ask_blockers and node.state != NodeState.AVAILABLE:
            raise _NodeLeftAvailable  # nothing written yet: rolled back, and asked again with the blockers
        before = {"state": node.state, "state_reason": node.state_reason}
        if state is not None:
            node.state = state
        if reason is not None:
            node.state_reason = reason[:255]
        if {"state": node.state, "state_reason": node.state_reason} == before:
            return node  # no change: nothing saved, and no audit entry of a change from A to A
        node.save()
        audit_record(actor=actor, action="node.update", obj=node, before=before,
                     after={"state": node.state, "state_reason": node.state_reason})
        if before["state"] != node.state:
            events.emit("node.state_changed", node_id=node.pk, old=before["state"], new=node.state)
    return node


def maintenance_window_create(*, actor: Any, node: Node, start: datetime, end: datetime, note: str = "") -> Allocation:
    """Block node for [start, end); refused if a reservation already holds it then."""
    return maintenance_windows_create(actor=actor, nodes=[node], start=start, end=end, note=note)[0]


def maintenance_windows_create(*, actor: Any, nodes: list[Node], start: datetime, end: datetime,
                               note: str = "") -> list[Allocation]:
    """Block every node for [start, end) in one transaction: all windows or none.

    Refused (CapacityUnavailable, naming each booked node and the reservations holding it) if
    any reservation holds one of the nodes then; bookings are never moved by maintenance.
    """
    now = timezone.now()
    for node in nodes:
        _raise_if(_validate_window(pool=node.pool, start=start, end=end, now=now))
    period = DateTimeTZRange(start, end, "[)")
    created: list[Allocation] = []
    with transaction.atomic(durable=True):
        # The pools' slot lengths as they are now, held until commit: a slot-length change waits for these
        # windows and sees them, one in flight is waited for and the windows judged on its grid.
        for slot_minutes in _lock_pools({n.pool_id for n in nodes}).values():
            _raise_if(_grid_errors(start=start, end=end, slot_minutes=slot_minutes))
        _lock_nodes([n.pk for n in nodes])  # queue behind a booker of these nodes rather than deadlock with it
        busy = (Allocation.objects.filter(node__in=nodes, active=True, period__overlap=period)
                .select_related("node").order_by("node__hostname", "period"))
        if busy:
            held = {}
            for a in busy:
                held.setdefault(a.node.hostname, []).append(
                    f"reservation #{a.reservation_id}" if a.reservation_id else "a maintenance window")
            raise CapacityUnavailable(
                "; ".join(f"{host} is booked during that window ({', '.join(who)})" for host, who in held.items())
                + ". Nothing was scheduled.", suggestions=[])
        try:
            for node in sorted(nodes, key=lambda n: n.pk):
                allocation = Allocation.objects.create(
                    node=node, period=period, kind=AllocationKind.MAINTENANCE, note=note[:255],
                    created_by=actor if getattr(actor, "pk", None) else None,
                )
                audit_record(actor=actor, action="node.maintenance", obj=allocation,
                             after={"node": node.hostname, "start": format_utc(start), "end": format_utc(end),
                                    "note": note})
                created.append(allocation)
        except IntegrityError as exc:
            if _sqlstate(exc) != EXCLUSION_VIOLATION:
                raise
            raise CapacityUnavailable("A node is booked during that window. Nothing was scheduled.", suggestions=[])
    return created


def maintenance_windows_end(*, actor: Any, nodes: list[Node], now: datetime | None = None) -> list[Allocation]:
    """Give the nodes back from their current and coming maintenance windows (a window entered by mistake, work
    finished early); return the windows changed.

    A window not yet begun is withdrawn (kept, inactive, for the record); one in progress ends at the
    next slot boundary (the nodes are bookable from there). All the nodes' windows or none, audited.
    """
    now = now or timezone.now()
    changed: list[Allocation] = []
    with transaction.atomic(durable=True):
        _lock_pools({n.pool_id for n in nodes})  # a window cut short ends on its pool's grid as it is now
        _lock_nodes([n.pk for n in nodes])  # the same queue as bookings and maintenance scheduling
        windows = list(
            Allocation.objects.select_for_update(of=("self",)).select_related("node__pool")
            .filter(node__in=nodes, kind=AllocationKind.MAINTENANCE, active=True, period__endswith__gt=now)
            .order_by("node_id", "period")
        )
        for window in windows:
            start, end = window.period.lower, window.period.upper
            if start >= now:
                window.active = False
                action, after = "node.maintenance.withdraw", {"active": False}
            else:
                new_end = slot_ceil(now, window.node.pool.slot_minutes)
                if new_end >= end:
                    continue  # it ends within this slot anyway
                window.period = DateTimeTZRange(start, new_end, "[)")
                action, after = "node.maintenance.end", {"end": format_utc(new_end)}
            window.save(update_fields=["active", "period"])
            audit_record(actor=actor, action=action, obj=window,
                         before={"node": window.node.hostname, "start": format_utc(start), "end": format_utc(end)},
                         after={"node": window.node.hostname, **after})
            changed.append(window)
    return changed


# --- failed nodes -----------------------------------------------------------------------


def node_replace_allocations(*, node: Node, actor: Any = None, reason: str = "") -> list[dict[str, Any]]:
    """Move every running and future booking off node onto a free spare of the same pool.

    A running allocation is cut at now (its past stays on record) and the rest of its window
    goes to a spare; a future one moves whole. The spare's allocation is inserted under the
    same exclusion constraint as any booking, so a swap racing a booking can never
    double-book: the loser of the race retries or, with no spare left, the reservation is
    marked degraded with the number of nodes it is missing. Returns one outcome per booking.
    """
    if Node.objects.filter(pk=node.pk, state=NodeState.AVAILABLE).exists():
        raise InvalidState(f"{node.hostname} is still available; drain or fail it before moving its bookings.")
    now = timezone.now()
    outcomes: list[dict[str, Any]] = []
    listed = list(
        Allocation.objects.filter(
            node=node, active=True, kind=AllocationKind.RESERVATION, period__endswith__gt=now,
            reservation__status__in=[s for s in ReservationStatus.values if s not in FINAL_STATUSES],
        ).values_list("id", "reservation_id")
    )
    for allocation_id, reservation_id in listed:
        try:
            outcomes.append(_replace_one(allocation_id=allocation_id, reservation_id=reservation_id, now=now,
                                         actor=actor, reason=reason))
        except Busy as exc:
            # The moves before it are committed (each is a transaction of its own): the caller records them;
            # a second call finds only what is left to move.
            exc.outcomes = outcomes
            raise
    return outcomes


def _replace_one(*, allocation_id: int, reservation_id: int, now: datetime, actor: Any,
                 reason: str) -> dict[str, Any]:
    """Move one booking off the node. A transaction lost to a concurrent one (a deadlock, e.g. with a cancel or a
    window change of the booking, or a serialization failure) is run again from the row lock on, on a fresh
    snapshot, at most PORTAL_BOOKING_MAX_ATTEMPTS times; then Busy (nothing written: the caller tries later)."""
    return _rerun_while_transient("node swap", lambda: _replace_one_once(
        allocation_id=allocation_id, reservation_id=reservation_id, now=now, actor=actor, reason=reason))


def _replace_one_once(*, allocation_id: int, reservation_id: int, now: datetime, actor: Any,
                      reason: str) -> dict[str, Any]:
    with transaction.atomic(durable=True):
        # Lock order as in reservation_update: the reservation, then its allocations.
        reservation = Reservation.objects.select_for_update().get(pk=reservation_id)
        # A move that re-picked the booking's nodes meanwhile deleted the row: nothing left on the node.
        allocation = (Allocation.objects.select_for_update(of=("self",)).select_related("node")
                      .filter(pk=allocation_id).first())
        if allocation is None or not allocation.active or allocation.period.upper <= now \
                or reservation.status in FINAL_STATUSES:
            return {"reservation_id": reservation.pk, "result": "unchanged"}
        old = allocation.node
        cut = max(allocation.period.lower, now)
        remaining = DateTimeTZRange(cut, allocation.period.upper, "[)")
        # The old row stays as the record of what the node served (up to the cut), inactive so
        # it no longer holds the node.
        if allocation.period.lower < cut:
            allocation.period = DateTimeTZRange(allocation.period.lower, cut, "[)")
        allocation.active = False
        allocation.replaced_at = cut
        allocation.note = f"replaced at {format_utc(cut)}: {reason}"[:255]
        allocation.save(update_fields=["period", "active", "replaced_at", "note"])
        spare = _insert_spare(reservation=reservation, period=remaining, actor=actor)
        before = _snapshot(reservation)
        if spare is None:
            reservation.missing_nodes += 1
            reservation.save(update_fields=["missing_nodes", "updated_at"])
            result = {"reservation_id": reservation.pk, "result": "degraded", "failed": old.hostname,
                      "missing_nodes": reservation.missing_nodes}
            # allocation_id (the row the node lost) names this failure: the same node failing again in the same
            # booking (it came back as a spare) is another failure, with another allocation.
            events.emit("reservation.degraded", reservation_id=reservation.pk, tenant_id=reservation.tenant_id,
                        node=old.hostname, missing_nodes=reservation.missing_nodes, reason=reason,
                        allocation_id=allocation.pk)
        else:
            reservation.save(update_fields=["updated_at"])  # its nodes changed: a revision (the feed's LAST-MODIFIED)
            result = {"reservation_id": reservation.pk, "result": "replaced", "failed": old.hostname,
                      "spare": spare.hostname}
            events.emit("node.replaced", reservation_id=reservation.pk, tenant_id=reservation.tenant_id,
                        failed=old.hostname, spare=spare.hostname, reason=reason, allocation_id=allocation.pk)
        audit_record(actor=actor, action="reservation.replace_node", obj=reservation,
                     tenant_id=reservation.tenant_id, before={**before, "node": old.hostname},
                     after={**_snapshot(reservation), **{k: v for k, v in result.items() if k != "reservation_id"}})
    return result


def _insert_spare(*, reservation: Reservation, period: DateTimeTZRange, actor: Any) -> Node | None:
    """Allocate one free available node of the reservation's pool for period, or None."""
    for _ in range(settings.PORTAL_BOOKING_MAX_ATTEMPTS):
        nodes = selectors.free_nodes(pool_id=reservation.pool_id, start=period.lower, end=period.upper, limit=1)
        if not nodes:
            return None
        try:
            with transaction.atomic():
                _allocate(reservation=reservation, node_ids=[nodes[0][0]], period=period, actor=actor)
            return Node.objects.get(pk=nodes[0][0])
        except _RETRYABLE as exc:
            if not _lost_node(exc):  # a deadlock goes up: the caller's transaction is run again whole
                raise
    return None


# --- lifecycle support for provisioning (appended; called by provisioning services) -------


def reservation_reopen(*, reservation_id: int, actor: Any, reason: str = "") -> Reservation:
    """Give a failed reservation another try (staff retry): hold its nodes again, back to confirmed.

    The nodes it held are claimed again through the exclusion constraint; if another booking
    took one of them meanwhile, nothing changes and CapacityUnavailable is raised. Nests
    inside the caller's transaction.
    """
    with transaction.atomic():
        reservation = Reservation.objects.select_for_update().filter(pk=reservation_id).first()
        if reservation is None:
            raise InvalidState(f"Reservation #{reservation_id} does not exist.")
        if reservation.status != ReservationStatus.FAILED:
            raise InvalidState(f"Reservation #{reservation.pk} is {reservation.status}, not failed.")
        if reservation.period.upper <= timezone.now():
            raise InvalidState(f"Reservation #{reservation.pk} has ended; it cannot be retried.")
        before = _snapshot(reservation)
        now = timezone.now()
        try:
            with transaction.atomic():
                # Allocations a node swap replaced stay released.
                reopened = reservation.allocations.filter(active=False, kind=AllocationKind.RESERVATION,
                                                          replaced_at__isnull=True)
                _lock_nodes(list(reopened.values_list("node_id", flat=True)))  # as bookers of them do
                # Read after the locks, so a node taken out of service since the failure is seen: its
                # allocation stays released and a spare of the pool takes the rest of the window.
                gone = list(reopened.exclude(node__state=NodeState.AVAILABLE).select_related("node"))
                reopened.filter(node__state=NodeState.AVAILABLE).update(active=True)
                for allocation in gone:
                    allocation.replaced_at = now
                    allocation.note = f"replaced at {format_utc(now)}: {allocation.node.hostname} is " \
                                      f"{allocation.node.state}"[:255]
                    allocation.save(update_fields=["replaced_at", "note"])
                    remaining = DateTimeTZRange(max(allocation.period.lower, now), allocation.period.upper, "[)")
                    if _insert_spare(reservation=reservation, period=remaining, actor=actor) is None:
                        raise CapacityUnavailable(
                            f"Reservation #{reservation.pk}'s node {allocation.node.hostname} is "
                            f"{allocation.node.state} and no spare is free for the rest of its window.",
                            suggestions=[])
        except IntegrityError as exc:
            if _sqlstate(exc) != EXCLUSION_VIOLATION:
                raise
            raise CapacityUnavailable(
                f"Reservation #{reservation.pk}'s nodes were booked by others since it failed.", suggestions=[])
        reservation.status = ReservationStatus.CONFIRMED
        reservation.status_reason = reason[:500]
        reservation.save(update_fields=["status", "status_reason", "updated_at"])
        audit_record(actor=actor, action="reservation.reopen", obj=reservation, tenant_id=reservation.tenant_id,
                     before=before, after=_snapshot(reservation))
        events.emit("reservation.reopened", reservation_id=reservation.pk, tenant_id=reservation.tenant_id)
    return reservation


# --- admin (appended) -------------------------------------------------------------------

__all__ += ["pool_update"]

POOL_FIELDS = ("gpu_model", "gpus_per_node", "slot_minutes", "on_demand_rate")


def pool_update(*, actor: Any, pool: Pool, expected: dict[str, Any] | None = None, **changes: Any) -> Pool:
    """Change a pool's description or rate; the slot length only while no booking is open in it.

    expected ({field: value}, what an edit page showed for the fields it changes): refused (InvalidState) if
    any is no longer so, checked under the pool's row lock."""
    with transaction.atomic(durable=True):
        # FOR UPDATE, not NO KEY UPDATE: it must conflict with the FOR KEY SHARE every booking takes with its
        # quota lock (_QUOTA_LOCK_SQL), so the open-booking check below sees a booking in flight once it commits.
        pool = Pool.objects.select_for_update().get(pk=pool.pk)
        refuse_stale(k for k, v in (expected or {}).items() if k in POOL_FIELDS and getattr(pool, k) != v)
        before = {f: str(getattr(pool, f)) for f in POOL_FIELDS}
        if "slot_minutes" in changes and changes["slot_minutes"] != pool.slot_minutes:
            slot = changes["slot_minutes"]
            if slot_minutes_error(slot):
                raise InvalidInput("slot_minutes: must divide a day.", fields={"slot_minutes": "Must divide 1440."})
            if Reservation.objects.filter(pool=pool, status__in=[s for s in ReservationStatus.values
                                                                 if s not in FINAL_STATUSES]).exists():
                raise InvalidState("The slot length cannot change while the pool has open reservations.")
            # Maintenance windows not over yet must sit on the new grid too (else they block half-slots). A window
            # being scheduled holds the pool row FOR KEY SHARE (_lock_pools): this lock waited for it, so it is seen.
            off_grid = [w for w in Allocation.objects.select_related("node").filter(
                            node__pool=pool, kind=AllocationKind.MAINTENANCE, reservation__isnull=True, active=True,
                            period__endswith__gt=timezone.now()).order_by("period", "node__hostname")
                        if _grid_errors(start=w.period.lower, end=w.period.upper, slot_minutes=slot)]
            if off_grid:
                named = "; ".join(f"{w.node.hostname} {format_utc(w.period.lower)} – {format_utc(w.period.upper)}"
                                  for w in off_grid[:10])
                more = f" and {len(off_grid) - 10} more" if len(off_grid) > 10 else ""
                raise InvalidState(
                    f"The slot length cannot change to {slot} minutes while the pool has maintenance windows off "
                    f"that grid ({named}{more}); end them or wait until they are over.",
                    fields={"slot_minutes": "Maintenance windows are off this grid."})
        for key in POOL_FIELDS:
            if key in changes:
                setattr(pool, key, changes[key])
        pool.save()
        audit_record(actor=actor, action="pool.update", obj=pool,
                     before=before, after={f: str(getattr(pool, f)) for f in POOL_FIELDS})
    return pool


# --- the per-slot availability summary (migration 0006) ----------------------------------


# Deltas moved per transaction: keeps each compaction short while a backlog drains.
COMPACT_BATCH = 50_000


def slot_usage_compact(*, batch: int = COMPACT_BATCH, max_batches: int = 100) -> int:
    """Fold pending PoolSlotUsageDelta rows into PoolSlotUsage; return how many were moved.

    Each batch is one statement (its own transaction outside an atomic block): readers see the
    deltas or their sum, never both. Concurrent compactions take disjoint batches.
    """
    moved = 0
    with connection.cursor() as cur:
        for _ in range(max_batches):
            cur.execute("SELECT reservations_slot_usage_compact(%s)", [batch])
            n = cur.fetchone()[0]
            moved += n
            if n < batch:
                break
    return moved


def slot_usage_rebuild(*, pool_id: int | None = None) -> dict[int, int]:
    """Recompute the summary of one pool (or every pool) from the allocations; return rows written per pool.

    Waits for the pool's in-flight writers and holds new ones off until the caller's transaction
    ends (the pool row is locked FOR NO KEY UPDATE), so the result is exact.
    """
    written: dict[int, int] = {}
    with connection.cursor() as cur:
        if pool_id is None:
            cur.execute("SELECT id FROM reservations_pool ORDER BY id")
            pool_ids = [row[0] for row in cur.fetchall()]
        else:
            pool_ids = [pool_id]
        for pk in pool_ids:
            cur.execute("SELECT reservations_slot_usage_rebuild(%s)", [pk])
            written[pk] = cur.fetchone()[0]
    return written


# One batch. = ANY(ARRAY(...)) looks the batch's ids up in the primary key; with IN (subquery)
# PostgreSQL hash-joined them against a sequential scan of the whole table, once per batch.
IDEMPOTENCY_KEYS_PRUNE_SQL = (
    "DELETE FROM reservations_idempotencykey WHERE id = ANY(ARRAY(SELECT id FROM reservations_idempotencykey"
    " WHERE created_at < %s ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED))"
)


def idempotency_keys_prune(*, now: datetime | None = None, batch: int = 10_000, max_batches: int = 1) -> int:
    """Forget Idempotency-Keys older than PORTAL_IDEMPOTENCY_KEY_TTL_HOURS; return how many went.

    A key replays its booking for at least that long; a client that retries later than that
    with the same key books again. A key whose twin request is still running is never taken
    (its row is locked until that booking commits or rolls back). Up to ``max_batches`` batches
    of ``batch`` keys, each one statement (its own transaction outside an atomic block); the
    beat's hourly run takes as many as it needs (reservations.tasks), so the prune keeps up with
    more than one batch an hour and drains a backlog the beat left while it was down.
    """
    hours = settings.PORTAL_IDEMPOTENCY_KEY_TTL_HOURS
    cutoff = (now or timezone.now()) - timedelta(hours=hours)
    pruned = 0
    with connection.cursor() as cur:
        for _ in range(max_batches):
            cur.execute(IDEMPOTENCY_KEYS_PRUNE_SQL, [cutoff, batch])
            pruned += cur.rowcount
            if cur.rowcount < batch:
                break
    if pruned:
        logger.info("pruned %d idempotency keys older than %d h", pruned, hours)
    return pruned
