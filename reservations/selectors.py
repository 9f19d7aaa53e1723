"""Reads: availability, tenant usage, suggestions. Each is one SQL statement, computed by PostgreSQL."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import F, Func, OuterRef, Subquery
from django.utils import timezone

from portal.core.redact import without_processes, without_secrets
from portal.core.words import count_of

from .choices import HOLDING_STATUSES, NodeState
from .models import Node, Pool, Reservation
from .timeutil import EPOCH, slot_ceil, slot_floor

__all__ = [
    "Slot",
    "availability",
    "availability_rows",
    "tenant_peak_usage",
    "tenant_peak_usage_by_pool",
    "free_node_ids",
    "free_nodes",
    "suggest_windows",
    "reservations_for_user",
    "pools_for_booking",
]


@dataclass(frozen=True)
class Slot:
    start: datetime
    end: datetime
    free_nodes: int


def reservations_for_user(*, user):
    return Reservation.objects.for_user(user).select_related("tenant", "pool", "created_by")


def pools_for_booking():
    """Pools with `bookable_nodes` (nodes not retired) read in the same query; the booking service uses it."""
    count = (Node.objects.filter(pool=OuterRef("pk")).exclude(state=NodeState.RETIRED).order_by()
             .annotate(n=Func(F("pk"), function="COUNT")).values("n"))
    return Pool.objects.annotate(bookable_nodes=Subquery(count))


# Availability from the per-slot summary.
#
# PoolSlotUsage holds, per pool and slot, the available nodes with an active allocation touching
# the slot; the triggers of migration 0006 append a PoolSlotUsageDelta row for every change and
# compaction (services.slot_usage_compact, every 10 s from beat) folds them in. So when the step
# is the pool's slot and the window starts on its grid, free nodes per slot = available nodes −
# (busy + pending deltas): one statement that reads about one row per slot, whatever the number
# of allocations. A step of
# several slots needs the distinct nodes busy anywhere in the step, which counts per slot cannot
# give, and a window off the grid cuts slots: those take the sweep below. The statement checks
# the pool's slot length itself (first column), in the same snapshot as the rows it reads, and
# returns one row: the pool's available nodes and the busy count of every slot, in order.
AVAILABILITY_SUMMARY_SQL = """
SELECT (SELECT slot_minutes * 60 = %(step_s)s FROM reservations_pool WHERE id = %(pool)s),
       (SELECT count(*) FROM reservations_node WHERE pool_id = %(pool)s AND state = 'available'),
       array_agg(coalesce(u.busy, 0) + coalesce(d.busy, 0) ORDER BY g.t)
FROM generate_series(%(start)s::timestamptz, %(end)s::timestamptz - make_interval(secs => %(step_s)s),
                     make_interval(secs => %(step_s)s)) AS g(t)
LEFT JOIN reservations_poolslotusage u
       ON u.pool_id = %(pool)s AND u.slot = g.t AND u.slot >= %(start)s AND u.slot < %(end)s
LEFT JOIN (
    SELECT slot, sum(delta) AS busy FROM reservations_poolslotusagedelta
    WHERE pool_id = %(pool)s AND slot >= %(start)s AND slot < %(end)s
    GROUP BY slot
) d ON d.slot = g.t
"""

# Availability as a sweep (any step, any window).
#
# Free nodes per slot = available nodes of the pool − nodes with an active allocation in the slot.
# Active allocations of one node never overlap (the exclusion constraint), so when every allocation
# boundary inside the window lies on the slot grid, "allocations touching slot i" equals "distinct
# nodes busy in slot i", and a sweep over start/end events gives the answer: +count at each
# (lower, upper) pair's first slot, −count after its last, a running sum over the slots.
# Grouping by (lower, upper) first turns ~70,000 allocations into a few thousand events (the nodes
# of one reservation share a period). The query also reports whether the grid assumption held;
# when it did not (a window not on the pool's slots, a step of several slots with bookings ending
# mid-step), AVAILABILITY_EXACT_SQL answers instead, merging each node's allocations before the sweep.
AVAILABILITY_GRID_SQL = """
WITH params AS (
    SELECT %(start)s::timestamptz AS t0, %(end)s::timestamptz AS t1, %(step_s)s::float8 AS st, %(n)s::int AS n
), ev AS (
    SELECT lower(a.period) AS lo, upper(a.period) AS hi, count(*) AS c
    FROM reservations_allocation a
    WHERE a.active AND a.period && tstzrange(%(start)s, %(end)s)
      AND a.node_id IN (SELECT id FROM reservations_node WHERE pool_id = %(pool)s AND state = 'available')
    GROUP BY 1, 2
), idx AS (
    SELECT greatest(0, floor(date_part('epoch', ev.lo - p.t0) / p.st))::int AS s,
           least(p.n, ceil(date_part('epoch', ev.hi - p.t0) / p.st))::int AS e,
           ev.c,
           (ev.lo <= p.t0 OR mod(date_part('epoch', ev.lo - p.t0)::numeric, p.st::numeric) = 0)
           AND (ev.hi >= p.t1 OR mod(date_part('epoch', ev.hi - p.t0)::numeric, p.st::numeric) = 0) AS aligned
    FROM ev, params p
), d AS (
    SELECT s AS i, sum(c) AS d FROM idx GROUP BY s
    UNION ALL
    SELECT e, -sum(c) FROM idx GROUP BY e
), agg AS (
    SELECT i, sum(d) AS d FROM d GROUP BY i
)
SELECT p.t0 + g * make_interval(secs => p.st),
       least(p.t0 + (g + 1) * make_interval(secs => p.st), p.t1),
       (SELECT count(*) FROM reservations_node WHERE pool_id = %(pool)s AND state = 'available')
           - coalesce(sum(agg.d) OVER (ORDER BY g), 0),
       (SELECT coalesce(bool_and(aligned), true) FROM idx)
FROM params p CROSS JOIN generate_series(0, p.n - 1) g
LEFT JOIN agg ON agg.i = g
ORDER BY g
"""

AVAILABILITY_EXACT_SQL = """
WITH params AS (
    SELECT %(start)s::timestamptz AS t0, %(end)s::timestamptz AS t1, %(step_s)s::float8 AS st, %(n)s::int AS n
), a AS (
    SELECT a.node_id,
           greatest(0, floor(date_part('epoch', lower(a.period) - p.t0) / p.st))::int AS s,
           least(p.n, ceil(date_part('epoch', upper(a.period) - p.t0) / p.st))::int AS e
    FROM params p, reservations_allocation a JOIN reservations_node n ON n.id = a.node_id
    WHERE n.pool_id = %(pool)s AND n.state = 'available' AND a.active AND a.period && tstzrange(%(start)s, %(end)s)
), m AS (
    SELECT s, e, max(e) OVER (PARTITION BY node_id ORDER BY s, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
           AS prev
    FROM a
), d AS (
    SELECT greatest(s, coalesce(prev, s)) AS i, 1 AS d FROM m WHERE e > coalesce(prev, s)
    UNION ALL
    SELECT e, -1 FROM m WHERE e > coalesce(prev, s)
), agg AS (
    SELECT i, sum(d) AS d FROM d GROUP BY i
)
SELECT p.t0 + g * make_interval(secs => p.st),
       least(p.t0 + (g + 1) * make_interval(secs => p.st), p.t1),
       (SELECT count(*) FROM reservations_node WHERE pool_id = %(pool)s AND state = 'available')
           - coalesce(sum(agg.d) OVER (ORDER BY g), 0),
       true
FROM params p CROSS JOIN generate_series(0, p.n - 1) g
LEFT JOIN agg ON agg.i = g
ORDER BY g
"""


def availability(*, pool: Pool, start: datetime, end: datetime, step: timedelta) -> list[Slot]:
    """Return free nodes per step between start and end: available nodes with no active allocation.

    One statement: the per-slot summary when step is the pool's slot on its grid
    (AVAILABILITY_SUMMARY_SQL), else a sweep (AVAILABILITY_GRID_SQL, a second statement only for
    windows off the grid).
    """
    with connection.cursor() as cur:
        rows = availability_rows(cur.cursor, pool_id=pool.pk, start=start, end=end, step=step)
    return [Slot(start=s, end=e, free_nodes=free) for s, e, free in rows]


def _summary_fits(start: datetime, end: datetime, step: timedelta) -> bool:
    """Whether whole slots of length step, on the UTC-epoch grid, tile [start, end)."""
    return (start.tzinfo is not None and end > start and step >= timedelta(seconds=1)
            and not step % timedelta(seconds=1) and not (start - EPOCH) % step and not (end - start) % step)


def availability_rows(cursor, *, pool_id: int, start: datetime, end: datetime, step: timedelta) -> list[tuple]:
    """Return [(slot start, slot end, free nodes)] on a DB-API cursor (Django's or plain psycopg)."""
    params = {"pool": pool_id, "start": start, "end": end, "step_s": step.total_seconds(),
              "n": math.ceil((end - start) / step)}
    if _summary_fits(start, end, step):
        cursor.execute(AVAILABILITY_SUMMARY_SQL, params)
        (fits, available, busy), = cursor.fetchall()
        if fits is True:  # the step is the pool's slot
            # One row, busy nodes per slot in slot order: the slots themselves are start + i × step.
            t0 = start.astimezone(UTC)
            return [(t0 + step * i, t0 + step * (i + 1), available - b) for i, b in enumerate(busy)]
    cursor.execute(AVAILABILITY_GRID_SQL, params)
    rows = cursor.fetchall()
    if rows and not rows[0][3]:
        cursor.execute(AVAILABILITY_EXACT_SQL, params)
        rows = cursor.fetchall()
    return [(s, e, int(free)) for s, e, free, _ in rows]


# The peak of a sum of intervals is reached at some interval's (clipped) start, so a sweep over
# those start points is exact; per pool, for one pool ({pool} filters) or every pool of the tenant.
_PEAK_SQL = """
    WITH r AS (
        SELECT pool_id, greatest(lower(period), %(start)s) AS s, least(upper(period), %(end)s) AS e, node_count
        FROM reservations_reservation
        WHERE tenant_id = %(tenant)s {pool} AND status = ANY(%(statuses)s)
          AND period && tstzrange(%(start)s, %(end)s) AND id <> %(exclude)s
        UNION ALL
        -- Torn down early (ending -> completed): it keeps its nodes to the booked end, so it counts while
        -- its allocations are active. Found through the partial index reservation_completed_until
        -- (tenant, pool, upper(period)) WHERE completed: only the tenant's completed reservations that
        -- end after the window starts, never its whole history (an OR on status here cost every
        -- booking a scan of it, under the quota lock), nor the fleet's allocations in the window.
        SELECT pool_id, greatest(lower(period), %(start)s), least(upper(period), %(end)s), node_count
        FROM reservations_reservation r
        WHERE status = 'completed' AND tenant_id = %(tenant)s {pool} AND upper(period) > %(start)s
          AND period && tstzrange(%(start)s, %(end)s) AND id <> %(exclude)s
          AND EXISTS (SELECT 1 FROM reservations_allocation a WHERE a.reservation_id = r.id AND a.active
                      AND a.period && tstzrange(%(start)s, %(end)s))
    )
    SELECT r1.pool_id, max((SELECT sum(r2.node_count) FROM r r2
                            WHERE r2.pool_id = r1.pool_id AND r2.s <= r1.s AND r2.e > r1.s))
    FROM r r1 GROUP BY r1.pool_id
"""
_PEAK_ONE_POOL_SQL = _PEAK_SQL.format(pool="AND pool_id = %(pool)s")
_PEAK_ALL_POOLS_SQL = _PEAK_SQL.format(pool="")


def _peaks(sql: str, params: dict[str, Any]) -> dict[int, int]:
    with connection.cursor() as cur:
        cur.execute(sql, {"statuses": list(HOLDING_STATUSES), "exclude": 0, **params})
        return {pool_id: int(peak or 0) for pool_id, peak in cur.fetchall()}


# tenant_peak_usage as a scalar subquery (0 when nothing is held), for a statement that reads it along with
# other things (the booking's rights, after its quota lock); its parameters are peak_params(...).
PEAK_ONE_POOL_SCALAR = f"(SELECT coalesce(max(peak), 0) FROM ({_PEAK_ONE_POOL_SQL}) AS peaks(pool_id, peak))"  # noqa: S608


def peak_params(
    *, tenant_id: int, pool_id: int, start: datetime, end: datetime, exclude_reservation_id: int | None = None
) -> dict[str, Any]:
    return {"tenant": tenant_id, "pool": pool_id, "start": start, "end": end, "statuses": list(HOLDING_STATUSES),
            "exclude": exclude_reservation_id or 0}


def tenant_peak_usage(
    *, tenant_id: int, pool_id: int, start: datetime, end: datetime, exclude_reservation_id: int | None = None
) -> int:
    """Return the most nodes the tenant holds in the pool at any instant of [start, end)."""
    params = peak_params(tenant_id=tenant_id, pool_id=pool_id, start=start, end=end,
                         exclude_reservation_id=exclude_reservation_id)
    return _peaks(_PEAK_ONE_POOL_SQL, params).get(pool_id, 0)


def tenant_peak_usage_by_pool(*, tenant_id: int, start: datetime, end: datetime) -> dict[int, int]:
    """tenant_peak_usage of every pool at once, {pool id: peak}, pools with nothing held left out:
    one statement whatever the number of pools (the dashboard's quota card)."""
    return _peaks(_PEAK_ALL_POOLS_SQL, {"tenant": tenant_id, "start": start, "end": end})


def free_node_ids(*, pool_id: int, start: datetime, end: datetime, limit: int) -> list[int]:
    """Return the ids of up to limit available nodes of the pool with nothing allocated in [start, end)."""
    return [node_id for node_id, _ in free_nodes(pool_id=pool_id, start=start, end=end, limit=limit)]


# Up to %(limit)s available nodes of the pool free over [start, end), at random. Random choice spreads concurrent
# bookers over different nodes, so fewer of them collide on the exclusion constraint and have to retry. The busy
# set is read once from the GiST index on active periods and probed as a hash (NOT IN over a non-null column): a
# plan that stays cheap whatever the statistics say, where NOT EXISTS could become a per-node index probe on a
# freshly loaded table (20 ms instead of 0.5 ms for a 1,000-node pool). The booking statement
# (services.BOOK_FUNCTION) runs it too.
FREE_NODES_SQL = """
    SELECT n.id, n.hostname FROM reservations_node n
    WHERE n.pool_id = %(pool)s AND n.state = %(available)s
      AND n.id NOT IN (
          SELECT a.node_id FROM reservations_allocation a
          WHERE a.active AND a.period && tstzrange(%(start)s, %(end)s)
      )
    ORDER BY random()
    LIMIT %(limit)s
"""


def free_nodes(*, pool_id: int, start: datetime, end: datetime, limit: int) -> list[tuple[int, str]]:
    """Return (id, hostname) of up to limit free nodes of the pool in [start, end), in id order (FREE_NODES_SQL)."""
    params = {"pool": pool_id, "available": NodeState.AVAILABLE, "start": start, "end": end, "limit": limit}
    with connection.cursor() as cur:
        cur.execute(FREE_NODES_SQL, params)
        return sorted(cur.fetchall())


# Suggestions: the nearest windows of the asked length with node_count free nodes.
#
# Free capacity for a window [t, t + dur) only changes where an allocation ends (earliest fit
# after) or where one begins (latest fit before), so those boundaries, snapped to the slot
# grid, are the only candidate starts worth testing (plus `earliest`): CTE cand, the boundaries
# of the pool's active allocations meeting the search range [lo, hi]. Each candidate is counted
# exactly, all of them in one sweep, not by a per-node probe per candidate (candidates × nodes
# index probes: 0.6-0.9 s on a busy 1,000-node pool): a node is free for [t, t + dur) iff t lies
# in [g0, g1 - dur] for one of its gaps [g0, g1) between consecutive active allocations (the
# exclusion constraint keeps one node's active allocations apart, so its gaps are disjoint and
# it counts once); a node with no allocation near the candidates is free for all of them. So
# free(t) = idle nodes + gaps open at t: +1 at each gap's g0, -1 just after its g1 - dur, a
# running sum over those events and the candidates in time order (at one instant: opens, then
# candidates, then closes).
#
# Reading every allocation of ±60 days costs ~30 ms on a busy 1,000-node pool before any counting,
# so suggest_windows first prunes with the per-slot summary (SUGGESTION_BOUND_SQL): every
# candidate is on the slot grid (earliest too, when _capacity_error passes the current slot; one
# off the grid is scored as it is), and a node busy in a slot wholly inside [t, t + dur) is busy
# in the window, so free(t) ≤ the fewest free nodes in those slots. Only the grid starts whose
# bound reaches node_count are scored, and only the allocations that can matter to them are read:
# those meeting [t - slot, t + dur + slot) of one of them (the ones whose snapped boundary lands on
# t, and the ones inside its window). A gap between two allocations read is then right for every
# start scored, whatever lies unread between them: an allocation inside a scored window is always
# read. The starts scored travel as runs of consecutive grid starts, [first, last] pairs
# (%(run_lo)s, %(run_hi)s), never one timestamp per slot: with 1-minute slots ±60 days is 172,800
# starts. The nearest starts on each side go first, then more of them, then the rest, each only
# for a side where none fitted yet (SUGGESTION_PASSES), so the worst case (the summary rules
# nothing out, nothing fits) reads the range about 1.3 times, never candidates × nodes.
SUGGESTIONS_SQL = """
WITH pa AS (
    SELECT a.node_id, a.period, lower(a.period) AS lo, upper(a.period) AS hi, n.state = %(available)s AS up
    FROM reservations_allocation a JOIN reservations_node n ON n.id = a.node_id
    WHERE n.pool_id = %(pool)s AND a.active AND a.period && (
        SELECT range_agg(tstzrange(l, u)) FROM unnest(%(read_lo)s::timestamptz[], %(read_hi)s::timestamptz[]) r(l, u)
    )
), ends AS MATERIALIZED (
    -- Distinct boundaries first (a few thousand among tens of thousands of allocations), snapped after.
    SELECT DISTINCT hi AS u FROM pa WHERE period && tstzrange(%(lo)s, %(hi)s)
), begins AS MATERIALIZED (
    SELECT DISTINCT lo AS l FROM pa WHERE period && tstzrange(%(lo)s, %(hi)s)
), cand AS (
    -- A candidate is on the grid (or is earliest, before every grid start): in a run means one of its starts.
    SELECT DISTINCT t FROM (
        SELECT to_timestamp(ceil(extract(epoch FROM u) / %(slot_s)s) * %(slot_s)s) AS t FROM ends
        UNION ALL
        SELECT to_timestamp(floor(extract(epoch FROM l - %(dur)s) / %(slot_s)s) * %(slot_s)s) FROM begins
        UNION ALL SELECT %(earliest)s::timestamptz
    ) c
    WHERE t >= %(earliest)s AND t + %(dur)s <= %(latest_end)s AND t <> %(start)s
      AND t >= %(lo)s AND t <= %(hi)s
      AND t <@ (SELECT range_agg(tstzrange(a, b, '[]'))
                FROM unnest(%(run_lo)s::timestamptz[], %(run_hi)s::timestamptz[]) r(a, b))
), alloc AS (
    SELECT node_id, hi, lag(hi) OVER (PARTITION BY node_id ORDER BY lo) AS g0, lo - %(dur)s AS g1
    FROM pa WHERE up
), fits AS (
    -- A node's gap before each allocation (g0 null: open since before the range), and after its last.
    SELECT g0, g1 FROM alloc WHERE g0 IS NULL OR g0 <= g1
    UNION ALL
    SELECT max(hi), NULL FROM alloc GROUP BY node_id
), ev AS (
    SELECT coalesce(g0, '-infinity'::timestamptz) AS t, 0 AS k, 1 AS d FROM fits
    UNION ALL
    SELECT g1, 2, -1 FROM fits WHERE g1 IS NOT NULL
    UNION ALL
    SELECT t, 1, 0 FROM cand
), scored AS (
    SELECT t, k, sum(d) OVER (ORDER BY t, k ROWS UNBOUNDED PRECEDING) AS open FROM ev
), idle AS (
    SELECT (SELECT count(*) FROM reservations_node WHERE pool_id = %(pool)s AND state = %(available)s)
           - (SELECT count(DISTINCT node_id) FROM alloc) AS n
)
SELECT max(t) FILTER (WHERE t < %(start)s), min(t) FILTER (WHERE t > %(start)s)
FROM scored, idle
WHERE k = 1 AND idle.n + open >= %(n)s
"""

# The per-slot summary's bound for suggest_windows, from the same rows as AVAILABILITY_SUMMARY_SQL
# (busy + pending deltas per slot of [start, end)) but only where they matter: the slots with
# fewer than n free nodes (busy > available - n), as runs of consecutive slot indexes from start
# (first, last), gaps-and-islands. A slot without rows has every available node free, and a request
# for more than the available nodes is answered before the bound is used, so only the slots with
# rows can block: the cost is the busy slots, never one row per slot of the range. Also the pool's
# slot length check (as in AVAILABILITY_SUMMARY_SQL) and its available nodes, in the same snapshot.
SUGGESTION_BOUND_SQL = """
WITH avail AS (
    SELECT count(*) AS n FROM reservations_node WHERE pool_id = %(pool)s AND state = 'available'
), over AS MATERIALIZED (
    -- Slots with fewer than n free nodes; not read at all when more nodes are asked than are available.
    SELECT coalesce(u.slot, d.slot) AS slot
    FROM (SELECT slot, busy FROM reservations_poolslotusage
          WHERE pool_id = %(pool)s AND slot >= %(start)s AND slot < %(end)s AND (SELECT n FROM avail) >= %(n)s) u
    FULL JOIN (SELECT slot, sum(delta) AS busy FROM reservations_poolslotusagedelta
               WHERE pool_id = %(pool)s AND slot >= %(start)s AND slot < %(end)s AND (SELECT n FROM avail) >= %(n)s
               GROUP BY slot) d ON d.slot = u.slot
    WHERE coalesce(u.busy, 0) + coalesce(d.busy, 0) > (SELECT n FROM avail) - %(n)s
), blocked AS (
    SELECT (extract(epoch FROM slot - %(start)s) / %(step_s)s)::bigint AS i
    FROM over WHERE mod(extract(epoch FROM slot - %(start)s), %(step_s)s) = 0
), islands AS (
    SELECT min(i) AS first, max(i) AS last
    FROM (SELECT i, i - row_number() OVER (ORDER BY i) AS g FROM blocked) b GROUP BY g
)
SELECT (SELECT slot_minutes * 60 = %(step_s)s FROM reservations_pool WHERE id = %(pool)s),
       (SELECT n FROM avail),
       coalesce((SELECT array_agg(first ORDER BY first) FROM islands), '{}'),
       coalesce((SELECT array_agg(last ORDER BY first) FROM islands), '{}')
"""

# How many starts on each side (the nearest the summary allows) the first passes score; the last scores the rest.
SUGGESTION_PASSES = (24, 240)

# Consecutive candidate starts: (first, how many, step); the step is negative for a side taken nearest first
# before start.
_Run = tuple[datetime, int, timedelta]


def suggest_windows(
    *, pool: Pool, node_count: int, start: datetime, end: datetime, earliest: datetime, latest_end: datetime,
    search: timedelta,
) -> list[dict[str, datetime]]:
    """Return the nearest windows of the same length with node_count free nodes, before and after start.

    The candidate starts are allocation boundaries snapped to the slot grid, within ±search of
    start, not before earliest, ending by latest_end; the per-slot summary rules out those that
    cannot fit, and SUGGESTIONS_SQL counts the rest exactly: the nearest first, then more of a
    side still without a fit (SUGGESTION_PASSES). One to four statements; one when node_count is
    more than the pool's available nodes (nothing can fit anywhere). The grid is never built:
    the starts are runs, (first, count, step), so the cost follows the busy slots and the runs.
    """
    duration = end - start
    step = timedelta(minutes=pool.slot_minutes)
    lo, hi = max(earliest, start - search), start + search
    params = {
        "pool": pool.pk,
        "available": NodeState.AVAILABLE,
        "lo": lo,
        "hi": hi,
        "slot_s": step.total_seconds(),
        "dur": duration,
        "earliest": earliest,
        "latest_end": latest_end,
        "start": start,
        "n": node_count,
    }

    def score(cur, runs: list[_Run]) -> tuple[datetime | None, datetime | None]:
        """The latest fit before start and the earliest after, among the candidates in runs."""
        if not runs:
            return None, None
        spans = sorted((min(f, f + st * (k - 1)), max(f, f + st * (k - 1))) for f, k, st in runs)
        # Each start t reads [t - step, t + dur + step): for a run of starts, one range from its first to its last.
        cur.execute(SUGGESTIONS_SQL, {**params, "run_lo": [a for a, _ in spans], "run_hi": [b for _, b in spans],
                                      "read_lo": [a - step for a, _ in spans],
                                      "read_hi": [b + duration + step for _, b in spans]})
        (before, after), = cur.fetchall()
        return before, after

    with connection.cursor() as cur:
        runs = _suggestion_starts(cur, pool=pool, lo=lo, hi=hi, last=min(hi, latest_end - duration),
                                  duration=duration, node_count=node_count)
        if runs is None:
            return []
        # earliest, when it is off the grid, is a candidate of its own before every grid start (on the grid it is one).
        if lo <= earliest <= hi and earliest + duration <= latest_end and (earliest - EPOCH) % step:
            runs.insert(0, (earliest, 1, step))
        earlier, later = _sides(runs, start)
        total = sum(k for _, k, _ in earlier) + sum(k for _, k, _ in later)
        before = after = None
        done = 0
        for upto in (*SUGGESTION_PASSES, total):
            batch = ((_take(earlier, done, upto) if before is None else [])
                     + (_take(later, done, upto) if after is None else []))
            done = upto
            if batch:
                more_before, more_after = score(cur, batch)
                before = before if before is not None else more_before
                after = after if after is not None else more_after
    return [{"start": t, "end": t + duration} for t in (before, after) if t is not None]


def _sides(runs: list[_Run], start: datetime) -> tuple[list[_Run], list[_Run]]:
    """Split runs (in time order, step > 0) at start, start itself left out: before it nearest first, after it."""
    earlier: list[_Run] = []
    later: list[_Run] = []
    for first, count, step in runs:
        below = 0 if start <= first else min(count, -((first - start) // step))  # starts < start
        if below:
            earlier.append((first + step * (below - 1), below, -step))
        above = 0 if start < first else (start - first) // step + 1  # the first index > start
        if above < count:
            later.append((first + step * above, count - above, step))
    earlier.reverse()
    return earlier, later


def _take(runs: list[_Run], lo: int, hi: int) -> list[_Run]:
    """The starts lo..hi - 1 of runs (counted along them), as runs."""
    out: list[_Run] = []
    offset = 0
    for first, count, step in runs:
        a, b = max(lo, offset), min(hi, offset + count)
        if a < b:
            out.append((first + step * (a - offset), b - a, step))
        offset += count
        if offset >= hi:
            break
    return out


def _suggestion_starts(
    cur, *, pool: Pool, lo: datetime, hi: datetime, last: datetime, duration: timedelta, node_count: int
) -> list[_Run] | None:
    """Return the grid starts in [lo, last] whose window [t, t + duration) may hold node_count free nodes, as runs
    in time order; None when node_count is more than the pool's available nodes (no window can ever fit).

    From the per-slot summary: free(t) ≤ the fewest free nodes in any slot wholly inside the
    window, so a start is ruled out when one of those slots has fewer than node_count free. A
    window that holds no whole slot, or a summary that is not on the pool's slot length, rules
    nothing out. The summary covers [floor(lo), ceil(hi + duration)); only its blocking slots are
    read, as runs, and the runs of starts are computed from them: nothing per slot.
    """
    step = timedelta(minutes=pool.slot_minutes)
    whole = duration // step
    t0 = slot_floor(lo, pool.slot_minutes)
    t1 = slot_ceil(hi + duration, pool.slot_minutes)
    cur.execute(SUGGESTION_BOUND_SQL, {"pool": pool.pk, "start": t0, "end": t1, "step_s": pool.slot_minutes * 60,
                                       "n": node_count})
    (fits, available, firsts, lasts), = cur.fetchall()
    if node_count > available:
        return None
    g0 = slot_ceil(lo, pool.slot_minutes)  # the first grid start
    count = (last - g0) // step + 1 if last >= g0 else 0
    if count <= 0:
        return []
    if whole < 1 or fits is not True:
        return [(g0, count, step)]
    # A blocked slot j rules out the starts whose window holds it: slot indexes j - whole + 1 .. j, of the
    # starts that have a bound at all (index < slots - whole + 1); grid start k is slot index k + shift.
    shift = (g0 - t0) // step
    bounded = (t1 - t0) // step - whole + 1 - shift  # grid starts k < bounded have a bound
    out: list[_Run] = []
    k = 0
    for j1, j2 in zip(firsts, lasts, strict=True):
        a = max(0, j1 - whole + 1 - shift)
        b = min(count - 1, j2 - shift, bounded - 1)
        if a > b:
            continue
        if a > k:
            out.append((g0 + step * k, a - k, step))
        k = max(k, b + 1)
    if k < count:
        out.append((g0 + step * k, count - k, step))
    return out


# --- browser portal reads (calendar, booking preview, dashboard, fleet, feed) -------------


def reservations_in_window(*, user, tenant, start: datetime, end: datetime, pool: Pool | None = None):
    """Return the tenant's reservations overlapping [start, end) that the user may see: one query.

    Cancelled and failed bookings hold nothing and are left out of the calendar.
    """
    from .choices import ReservationStatus

    qs = (
        Reservation.objects.for_user(user)
        .for_tenant(tenant)
        .filter(period__overlap=(start, end))
        .exclude(status__in=[ReservationStatus.CANCELLED, ReservationStatus.FAILED])
        .select_related("pool")
        .order_by("period", "id")
    )
    if pool is not None:
        qs = qs.filter(pool=pool)
    return qs


@dataclass(frozen=True)
class BookingPreview:
    """What a booking would look like, read without locks: the service still decides on submit."""

    pool: Pool
    node_count: int
    start: datetime
    end: datetime
    available_nodes: int
    free_nodes: int
    has_quota: bool
    max_nodes: int = 0
    burst_nodes: int = 0
    burst_enabled: bool = False
    max_duration_hours: int | None = None
    peak_before: int = 0
    billing: str | None = None
    burst_part_nodes: int = 0
    # What else stops the booking (free nodes, duration, no quota). Over the limit is not repeated
    # here: `over_limit_text` says it, once, in the quota row.
    problems: tuple[str, ...] = ()

    @property
    def hours(self) -> float:
        return (self.end - self.start).total_seconds() / 3600

    @property
    def peak_after(self) -> int:
        return self.peak_before + self.node_count

    @property
    def limit(self) -> int:
        return self.max_nodes + (self.burst_nodes if self.burst_enabled else 0)

    @property
    def over_limit_text(self) -> str:
        """Over the limit, what the tenant would hold at its peak against it, in words; "" within it."""
        over = self.peak_after - self.limit
        if not self.has_quota or over <= 0:
            return ""
        parts = f"{self.max_nodes} guaranteed"
        if self.burst_enabled and self.burst_nodes:
            parts += f" + {self.burst_nodes} burst"
        return (f"You would hold up to {count_of(self.peak_after, 'node')} at once; "
                f"your limit is {self.limit} ({parts}): {over} over.")

    @property
    def burst_gpu_hours(self):
        from decimal import Decimal

        return (Decimal(self.burst_part_nodes * self.pool.gpus_per_node) * Decimal(str(self.hours))).quantize(
            Decimal("0.01")
        )

    @property
    def burst_cost(self):
        from decimal import Decimal

        return (self.burst_gpu_hours * Decimal(str(self.pool.on_demand_rate))).quantize(Decimal("0.01"))

    @property
    def ok(self) -> bool:
        return not self.problems and not self.over_limit_text


def booking_preview(
    *, tenant, pool: Pool, node_count: int, start: datetime, end: datetime,
    exclude_reservation_id: int | None = None,
) -> BookingPreview:
    """Return free nodes, quota use after booking, committed vs burst and the burst part's cost.

    The quota arithmetic is the same as the booking service's (`services._classify_billing`),
    read without its row lock; a test keeps the two in agreement. Three queries.
    """
    from tenants.models import Quota

    sql = """
        SELECT count(*) FILTER (WHERE NOT EXISTS (
                   SELECT 1 FROM reservations_allocation a
                   WHERE a.node_id = n.id AND a.active AND a.period && tstzrange(%(start)s, %(end)s)
                     -- a maintenance window (no reservation) always takes its node; NULL is not
                     -- "distinct from" an exclude of NULL, so it needs saying
                     AND (a.reservation_id IS NULL OR a.reservation_id IS DISTINCT FROM %(exclude)s))),
               count(*)
        FROM reservations_node n WHERE n.pool_id = %(pool)s AND n.state = %(available)s
    """
    with connection.cursor() as cur:
        cur.execute(sql, {"pool": pool.pk, "available": NodeState.AVAILABLE, "start": start, "end": end,
                          "exclude": exclude_reservation_id})
        free, available = (int(v) for v in cur.fetchone())
    problems: list[str] = []
    if free < node_count:
        problems.append(f"Only {free} of {available} available {pool.name} nodes are free for the whole window.")
    quota = Quota.objects.for_tenant(tenant).filter(pool=pool).first()
    if quota is None:
        problems.append(f"{tenant.name} has no quota for {pool.name}.")
        return BookingPreview(pool=pool, node_count=node_count, start=start, end=end, available_nodes=available,
                              free_nodes=free, has_quota=False, problems=tuple(problems))
    peak = tenant_peak_usage(tenant_id=tenant.pk, pool_id=pool.pk, start=start, end=end,
                             exclude_reservation_id=exclude_reservation_id)
    hours = (end - start).total_seconds() / 3600
    if quota.max_duration_hours is not None and hours > quota.max_duration_hours:
        problems.append(f"{hours:g} h is longer than the {quota.max_duration_hours} h allowed in {pool.name}.")
    billing, burst_part = None, 0
    limit = quota.max_nodes + (quota.burst_nodes if tenant.burst_enabled else 0)
    if peak + node_count <= quota.max_nodes:
        billing = "committed"
    elif peak + node_count <= limit:
        billing = "burst"
        burst_part = min(node_count, peak + node_count - quota.max_nodes)
    # else over the limit: no billing, and BookingPreview.over_limit_text says so (not ok).
    return BookingPreview(
        pool=pool, node_count=node_count, start=start, end=end, available_nodes=available, free_nodes=free,
        has_quota=True, max_nodes=quota.max_nodes, burst_nodes=quota.burst_nodes,
        burst_enabled=tenant.burst_enabled, max_duration_hours=quota.max_duration_hours, peak_before=peak,
        billing=billing, burst_part_nodes=burst_part, problems=tuple(problems),
    )


@dataclass(frozen=True)
class QuotaUsage:
    pool: Pool
    max_nodes: int
    burst_nodes: int
    burst_enabled: bool
    peak_now: int
    peak_ahead: int

    @property
    def limit(self) -> int:
        return self.max_nodes + (self.burst_nodes if self.burst_enabled else 0)


def tenant_quota_usage(*, tenant, now: datetime, days: int = 14) -> list[QuotaUsage]:
    """Return, per pool the tenant has a quota in, its peak nodes now and over the next days."""
    from tenants.models import Quota

    quotas = list(Quota.objects.for_tenant(tenant).select_related("pool").order_by("pool__name"))
    if not quotas:
        return []
    # Three queries whatever the number of pools: the quotas, the peaks now, the peaks ahead.
    now_peaks = tenant_peak_usage_by_pool(tenant_id=tenant.pk, start=now, end=now + timedelta(seconds=1))
    ahead_peaks = tenant_peak_usage_by_pool(tenant_id=tenant.pk, start=now, end=now + timedelta(days=days))
    return [
        QuotaUsage(pool=quota.pool, max_nodes=quota.max_nodes, burst_nodes=quota.burst_nodes,
                   burst_enabled=tenant.burst_enabled, peak_now=now_peaks.get(quota.pool_id, 0),
                   peak_ahead=ahead_peaks.get(quota.pool_id, 0))
        for quota in quotas
    ]


def reservation_history(*, reservation: Reservation):
    """Return the audit trail of one reservation, oldest first: its status timeline."""
    from portal.core.models import AuditLog

    return (
        AuditLog.objects.filter(object_type=Reservation._meta.label_lower, object_id=str(reservation.pk))
        .select_related("actor")
        .order_by("created_at", "id")
    )


def tenant_recent_activity(*, tenant, limit: int = 10):
    """Return the latest audited changes concerning the tenant, newest first."""
    from portal.core.models import AuditLog

    return AuditLog.objects.filter(tenant_id=tenant.pk).select_related("actor").order_by("-created_at", "-id")[
        :limit
    ]


def node_state_reason_as_seen_by(user, node: Node) -> str:
    """A node's state reason as the user may read it: staff read it as stored; anyone else without the processes
    it names. Health failure reasons used to name them ("pids [...]", an XID line's "pid=…, name=…"): the work of
    whichever team was on the node. New reasons name none, but rows written before still do."""
    if getattr(user, "is_staff", False):
        return node.state_reason
    # A reason may be a tool's or a backend's output too: no credential it carried (portal.core.redact).
    return without_secrets(without_processes(node.state_reason or ""), limit=None)


def fleet_nodes(*, pool: Pool | None = None):
    """The fleet timeline's rows: nodes not retired, by pool and hostname (a queryset, to page)."""
    nodes = Node.objects.select_related("pool").exclude(state=NodeState.RETIRED).order_by("pool__name", "hostname")
    return nodes if pool is None else nodes.filter(pool=pool)


def fleet_timeline(*, user, start: datetime, end: datetime, nodes):
    """Return (nodes, allocations overlapping [start, end) grouped by node id) for the rows to show (a page
    of fleet_nodes).

    Meant for staff, who see every tenant's allocations through the same tenant scope.
    """
    from collections import defaultdict

    from .models import Allocation

    nodes = list(nodes)
    allocations = (
        Allocation.objects.for_user(user)
        .filter(active=True, period__overlap=(start, end), node_id__in=[n.pk for n in nodes])
        .select_related("reservation__tenant")
        .order_by("period")
    )
    by_node: dict[int, list] = defaultdict(list)
    for allocation in allocations:
        by_node[allocation.node_id].append(allocation)
    return nodes, by_node


def pool_heatmap(*, start: datetime, end: datetime) -> list[tuple[Pool, int, list[Slot]]]:
    """Return (pool, available nodes, free-node slots covering [start, end)) for every pool: one query per pool.

    The slots are the pool's own, on its grid (availability_on_grid).
    """
    from django.db.models import Count, Q

    pools = Pool.objects.annotate(
        available_nodes=Count("nodes", filter=Q(nodes__state=NodeState.AVAILABLE))
    ).order_by("name")
    return [(pool, pool.available_nodes, availability_on_grid(pool=pool, start=start, end=end)) for pool in pools]


def availability_on_grid(*, pool: Pool, start: datetime, end: datetime) -> list[Slot]:
    """Free nodes per slot of the pool's own grid (from the UTC epoch), widened to whole slots around
    [start, end): for pages whose window starts at a local midnight that may lie off that grid (+05:30,
    or any zone for a daily pool), which would otherwise cut slots in two and show each half with the
    other's bookings. Over PORTAL_AVAILABILITY_MAX_SLOTS slots, whole multiples of the slot."""
    minutes = pool.slot_minutes
    while (slot_ceil(end, minutes) - slot_floor(start, minutes)) / timedelta(minutes=minutes) \
            > settings.PORTAL_AVAILABILITY_MAX_SLOTS:
        minutes *= 2
    return availability(pool=pool, start=slot_floor(start, minutes), end=slot_ceil(end, minutes),
                        step=timedelta(minutes=minutes))


def feed_reservations(*, tenant, since: datetime):
    """Return the tenant's reservations ending after since, with their active nodes, for the feed."""
    from django.db.models import CharField, Count, Prefetch
    from django.db.models.functions import Cast, Coalesce

    from portal.core.models import AuditLog

    from .models import Allocation

    active = Prefetch("allocations", queryset=Allocation.objects.filter(active=True).select_related("node"),
                      to_attr="active_allocations")
    changes = (
        AuditLog.objects.filter(object_type=Reservation._meta.label_lower,
                                object_id=Cast(OuterRef("pk"), output_field=CharField()))
        .order_by().values("object_type").annotate(n=Count("id")).values("n")
    )
    return (
        Reservation.objects.for_tenant(tenant)
        .filter(period__endswith__gt=since)
        .annotate(audited_changes=Coalesce(Subquery(changes), 0))
        .select_related("pool")
        .prefetch_related(active)
        .order_by("period", "id")
    )


__all__ += [
    "reservations_in_window",
    "BookingPreview",
    "booking_preview",
    "QuotaUsage",
    "tenant_quota_usage",
    "reservation_history",
    "tenant_recent_activity",
    "fleet_nodes",
    "fleet_timeline",
    "availability_on_grid",
    "pool_heatmap",
    "feed_reservations",
]


# --- usage (GPU-hours per tenant, pool and billing) ---------------------------------------

# GPU-hours in [start, end) per tenant and pool, committed and burst, split at `now` into used and booked
# ahead; a line per rate and GPUs per node the bookings were billed at (each reservation's own, recorded
# when it was booked: a pool's later change re-prices nothing), in the order first booked to start. Of a
# burst booking's node-hours the share burst_part_nodes / node_count (its nodes above the guarantee, as
# the booking preview priced them) is burst, the rest committed.
# What counts is what a tenant held: a reservation's active allocations, and those a node swap
# released up to the swap (replaced_at; one moved whole before its start held nothing) — so a node
# swapped for a spare counts once, and the hours a degraded booking went without a node do not
# count — whether it ran to its end, was torn down early (its nodes stay booked: paid for) or is
# still ahead. A cancel releases the allocations it still had whole: they count up to the cancel
# (cancelled_at; one cancelled before it began counts nothing), so a degraded booking cancelled later
# counts only the nodes it held. One whose teardown failed (it
# ran; its allocations were released whole then) counts up to that moment (released_at), also once a
# staff retry completes it. One failed while provisioning never ran: it counts nothing.
# The period test is written once per arm of `active`: each arm is then read off its partial GiST index
# (active: the no-double-booking one; released: reservations_allocation_released_period) instead of a scan
# of every allocation ever booked.
USAGE_SQL = """
WITH spans AS (
    SELECT r.tenant_id, r.pool_id, r.gpus_per_node, r.on_demand_rate, lower(r.period) AS booked_start,
           CASE WHEN r.billing = 'burst' THEN r.burst_part_nodes::numeric / r.node_count ELSE 0 END AS burst,
           CASE WHEN a.active THEN a.period
                WHEN a.replaced_at IS NOT NULL THEN a.period * tstzrange(NULL, a.replaced_at)
                ELSE a.period * tstzrange(NULL, coalesce(r.cancelled_at, r.released_at)) END AS span
    FROM reservations_allocation a JOIN reservations_reservation r ON r.id = a.reservation_id
    WHERE ((a.active AND a.period && tstzrange(%(start)s, %(end)s))
           OR (NOT a.active AND a.period && tstzrange(%(start)s, %(end)s)))
      AND (a.active OR a.replaced_at > lower(a.period)
           OR coalesce(r.cancelled_at, r.released_at) > lower(a.period))
      AND a.kind = 'reservation'
      AND (r.status <> 'failed' OR r.released_at IS NOT NULL)
      AND (%(tenants)s::bigint[] IS NULL OR r.tenant_id = ANY(%(tenants)s::bigint[]))
), clipped AS (
    SELECT tenant_id, pool_id, gpus_per_node, on_demand_rate, booked_start, burst,
           span * tstzrange(%(start)s, %(end)s) AS span FROM spans
), hours AS (
    SELECT tenant_id, pool_id, gpus_per_node, on_demand_rate, booked_start, burst,
           CASE WHEN isempty(s) THEN 0 ELSE extract(epoch FROM upper(s) - lower(s)) / 3600.0 END AS used,
           CASE WHEN isempty(f) THEN 0 ELSE extract(epoch FROM upper(f) - lower(f)) / 3600.0 END AS ahead
    FROM (SELECT tenant_id, pool_id, gpus_per_node, on_demand_rate, booked_start, burst,
                 span * tstzrange(NULL, %(now)s) AS s, span * tstzrange(%(now)s, NULL) AS f
          FROM clipped) parts
)
SELECT tenant_id, pool_id, gpus_per_node, on_demand_rate, min(booked_start),
       coalesce(sum(used * (1 - burst)), 0), coalesce(sum(used * burst), 0),
       coalesce(sum(ahead * (1 - burst)), 0), coalesce(sum(ahead * burst), 0)
FROM hours
GROUP BY tenant_id, pool_id, gpus_per_node, on_demand_rate
"""


@dataclass
class UsageLine:
    """One tenant's use of one pool over a period, in GPU-hours, split into used and booked ahead, at the GPUs
    per node and on-demand rate (per GPU-hour) its bookings were billed at when booked."""

    tenant: Any
    pool: Pool
    gpus_per_node: int
    rate: Decimal
    committed_used: Decimal
    burst_used: Decimal
    committed_ahead: Decimal
    burst_ahead: Decimal

    @property
    def burst_cost_used(self) -> Decimal:
        return (self.burst_used * self.rate).quantize(Decimal("0.01"))

    @property
    def burst_cost_ahead(self) -> Decimal:
        return (self.burst_ahead * self.rate).quantize(Decimal("0.01"))


def usage_for_period(*, start: datetime, end: datetime, tenant_ids: list[int] | None,
                     now: datetime | None = None) -> list[UsageLine]:
    """GPU-hours each tenant (all, or those of tenant_ids) held in each pool in [start, end), one query.

    Committed hours are covered by the quota; burst hours are charged at the on-demand rate (per GPU-hour)
    each booking was booked at. Ordered by tenant slug, then pool name, then the first booking's start:
    bookings billed at another rate or GPUs per node (the pool changed between them) are a line of their own.
    """
    from tenants.models import Tenant

    now = now or timezone.now()
    with connection.cursor() as cur:
        cur.execute(USAGE_SQL, {"start": start, "end": end, "now": now, "tenants": tenant_ids})
        rows = cur.fetchall()
    pools = {p.pk: p for p in Pool.objects.filter(pk__in={r[1] for r in rows})}
    tenants = {t.pk: t for t in Tenant.objects.filter(pk__in={r[0] for r in rows})}
    lines: list[tuple[datetime, UsageLine]] = []
    for tenant_id, pool_id, gpus_per_node, rate, first_start, *node_hours in rows:
        committed_used, burst_used, committed_ahead, burst_ahead = (
            (Decimal(str(h)) * gpus_per_node).quantize(Decimal("0.01")) for h in node_hours)
        if any((committed_used, burst_used, committed_ahead, burst_ahead)):
            lines.append((first_start, UsageLine(tenants[tenant_id], pools[pool_id], gpus_per_node, Decimal(rate),
                                                 committed_used, burst_used, committed_ahead, burst_ahead)))
    lines.sort(key=lambda pair: (pair[1].tenant.slug, pair[1].pool.name, pair[0]))
    return [line for _first, line in lines]


__all__ += ["UsageLine", "usage_for_period"]
