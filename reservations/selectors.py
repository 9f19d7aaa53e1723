"""Reads: availability, tenant usage, suggestions. Each is one SQL statement, computed by PostgreSQL."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection

from .choices import HOLDING_STATUSES, NodeState
from .models import Pool, Reservation

__all__ = [
    "Slot",
    "availability",
    "tenant_peak_usage",
    "free_node_ids",
    "free_nodes",
    "suggest_windows",
    "reservations_for_user",
]


@dataclass(frozen=True)
class Slot:
    start: datetime
    end: datetime
    free_nodes: int


def reservations_for_user(*, user):
    return Reservation.objects.for_user(user).select_related("tenant", "pool", "created_by")


def availability(*, pool: Pool, start: datetime, end: datetime, step: timedelta) -> list[Slot]:
    """Return free nodes per step between start and end: available nodes with no active allocation.

    One statement: the slot series is joined to the overlapping allocations of the pool's
    available nodes and counted per slot, so the cost does not grow with Python loops.
    """
    sql = """
        WITH avail AS (
            SELECT id FROM reservations_node WHERE pool_id = %(pool)s AND state = %(available)s
        ), slots AS (
            SELECT g AS s, least(g + %(step)s, %(end)s) AS e
            FROM generate_series(%(start)s::timestamptz, %(end)s::timestamptz - interval '1 microsecond', %(step)s) g
        )
        SELECT slots.s, slots.e, (SELECT count(*) FROM avail) - count(DISTINCT a.node_id)
        FROM slots
        LEFT JOIN reservations_allocation a
            ON a.active AND a.period && tstzrange(slots.s, slots.e) AND a.node_id IN (SELECT id FROM avail)
        GROUP BY slots.s, slots.e
        ORDER BY slots.s
    """
    params = {"pool": pool.pk, "available": NodeState.AVAILABLE, "start": start, "end": end, "step": step}
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return [Slot(start=s, end=e, free_nodes=int(free)) for s, e, free in cur.fetchall()]


def tenant_peak_usage(
    *, tenant_id: int, pool_id: int, start: datetime, end: datetime, exclude_reservation_id: int | None = None
) -> int:
    """Return the most nodes the tenant holds in the pool at any instant of [start, end).

    The peak of a sum of intervals is reached at some interval's (clipped) start, so a
    sweep over those start points is exact.
    """
    sql = """
        WITH r AS (
            SELECT greatest(lower(period), %(start)s) AS s, least(upper(period), %(end)s) AS e, node_count
            FROM reservations_reservation
            WHERE tenant_id = %(tenant)s AND pool_id = %(pool)s AND status = ANY(%(statuses)s)
              AND period && tstzrange(%(start)s, %(end)s) AND id <> %(exclude)s
        )
        SELECT coalesce(max((SELECT sum(r2.node_count) FROM r r2 WHERE r2.s <= r1.s AND r2.e > r1.s)), 0)
        FROM r r1
    """
    params = {
        "tenant": tenant_id,
        "pool": pool_id,
        "start": start,
        "end": end,
        "statuses": list(HOLDING_STATUSES),
        "exclude": exclude_reservation_id or 0,
    }
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return int(cur.fetchone()[0])


def free_node_ids(*, pool_id: int, start: datetime, end: datetime, limit: int) -> list[int]:
    """Return the ids of up to limit available nodes of the pool with nothing allocated in [start, end)."""
    return [node_id for node_id, _ in free_nodes(pool_id=pool_id, start=start, end=end, limit=limit)]


def free_nodes(*, pool_id: int, start: datetime, end: datetime, limit: int) -> list[tuple[int, str]]:
    """Return (id, hostname) of up to limit free nodes of the pool in [start, end), in id order.

    Random choice spreads concurrent bookers over different nodes, so fewer of them collide on
    the exclusion constraint and have to retry.
    """
    sql = """
        SELECT n.id, n.hostname FROM reservations_node n
        WHERE n.pool_id = %(pool)s AND n.state = %(available)s
          AND NOT EXISTS (
              SELECT 1 FROM reservations_allocation a
              WHERE a.node_id = n.id AND a.active AND a.period && tstzrange(%(start)s, %(end)s)
          )
        ORDER BY random()
        LIMIT %(limit)s
    """
    params = {"pool": pool_id, "available": NodeState.AVAILABLE, "start": start, "end": end, "limit": limit}
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return sorted(cur.fetchall())


def suggest_windows(
    *, pool: Pool, node_count: int, start: datetime, end: datetime, earliest: datetime, latest_end: datetime,
    search: timedelta,
) -> list[dict[str, datetime]]:
    """Return the nearest windows of the same length with node_count free nodes, before and after start.

    Free capacity for a window only changes where an allocation ends (earliest fit after) or
    where one begins (latest fit before), so those boundaries, snapped to the slot grid, are
    the only candidates worth testing.
    """
    duration = end - start
    step = timedelta(minutes=pool.slot_minutes)
    sql = """
        WITH busy AS (
            SELECT a.period FROM reservations_allocation a JOIN reservations_node n ON n.id = a.node_id
            WHERE n.pool_id = %(pool)s AND a.active AND a.period && tstzrange(%(lo)s, %(hi)s)
        ), cand AS (
            SELECT DISTINCT t FROM (
                SELECT to_timestamp(ceil(extract(epoch FROM upper(period)) / %(slot_s)s) * %(slot_s)s) AS t
                FROM busy
                UNION ALL
                SELECT to_timestamp(floor(extract(epoch FROM lower(period) - %(dur)s) / %(slot_s)s) * %(slot_s)s)
                FROM busy
                UNION ALL SELECT %(earliest)s::timestamptz
            ) c
            WHERE t >= %(earliest)s AND t + %(dur)s <= %(latest_end)s AND t <> %(start)s
              AND t >= %(lo)s AND t <= %(hi)s
        ), scored AS (
            SELECT t, (
                SELECT count(*) FROM reservations_node n
                WHERE n.pool_id = %(pool)s AND n.state = %(available)s
                  AND NOT EXISTS (
                      SELECT 1 FROM reservations_allocation a
                      WHERE a.node_id = n.id AND a.active AND a.period && tstzrange(cand.t, cand.t + %(dur)s)
                  )
            ) AS free
            FROM cand
        )
        (SELECT t FROM scored WHERE t < %(start)s AND free >= %(n)s ORDER BY t DESC LIMIT 1)
        UNION ALL
        (SELECT t FROM scored WHERE t > %(start)s AND free >= %(n)s ORDER BY t ASC LIMIT 1)
    """
    params = {
        "pool": pool.pk,
        "available": NodeState.AVAILABLE,
        "lo": max(earliest, start - search),
        "hi": start + search,
        "slot_s": step.total_seconds(),
        "dur": duration,
        "earliest": earliest,
        "latest_end": latest_end,
        "start": start,
        "n": node_count,
    }
    with connection.cursor() as cur:
        cur.execute(sql, params)
        starts = sorted(row[0] for row in cur.fetchall())
    return [{"start": t, "end": t + duration} for t in starts]
