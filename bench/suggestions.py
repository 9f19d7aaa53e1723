#!/usr/bin/env python
"""Suggestions on a refused booking: reservations.selectors.suggest_windows on a busy 1,000-node pool.

    .venv/bin/python bench/suggestions.py [--nodes 1000] [--allocations 50000] [--requests 30] [--reseed]
                                          [--check]
    .venv/bin/python bench/suggestions.py --slot-minutes 1


A capacity_unavailable refusal carries the nearest windows of the same length that would fit
(DESIGN §4): services._capacity_error calls suggest_windows with the booking's window, earliest =
the current slot, latest_end = the horizon and a search of ±PORTAL_SUGGESTION_SEARCH_DAYS. This
benchmark times that call alone, in-process (Django cursor), which is what a refusal costs the
database beyond the booking attempt itself.

What it does:

1. Creates the database ``portal_suggestions`` (``BENCH_SUGGESTIONS_DB``) on the dev server
   (DATABASE_URL, else the embedded one), migrates it and loads ``manage.py seed_scale --nodes N
   --allocations M --days-back D`` once (reused while the counts match; --reseed loads it again):
   racks of 8 nodes booked back to back (1-8 nodes per reservation, 4 h to a week, idle gaps),
   from D days ago to about three months ahead, ~4 % of the nodes drained/failed/in maintenance,
   a few maintenance windows and cancelled bookings.
2. Draws --requests refused requests (seeded): a start 1-25 days ahead on the slot grid, a length
   of 4-48 h and more nodes than are free then (free + 1 + up to 200, at most the available nodes),
   plus one request where nothing fits in ±60 days (every available node for 48 h): no early
   stop on either side (the per-slot summary rules it out at once; the slowest requests are
   rather long windows, where the summary's bound is loose and many starts are counted exactly).
3. Times suggest_windows for each (a warm-up pass first) and prints p50/p95 over all of them, the
   nothing-fits case on its own, and p95 against the limit (LIMIT_MS) as a ratio.

--slot-minutes M times short slots instead (the grid of ±60 days is 172,800 starts with 1-minute slots), on
a pool of its own in the same database (``bench-slots-M``, loaded once, the scale load left alone): 30
nodes, each down one hour every twelve, staggered 24 minutes apart, from 62 days back to 63 ahead, and
compacted: every slot has nodes free, so the per-slot summary rules no start out, but no 24-hour window
has a node free throughout. It times two refusals: one node for 24 h (nothing fits in ±60 days, every
start counted) and 31 nodes of the 30 for 4 h (more than the pool has: nothing can ever fit).

--check also runs the statement suggest_windows used before it was a sweep (REFERENCE_SQL: an exact
per-node count for every candidate) once per request, requires the same answers and prints its
times for comparison (about a second per request on this pool).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, base_database_url, manage, percentile, psycopg_kwargs, with_dbname  # noqa: E402

sys.path.insert(0, str(ROOT))
POOL = "scale-p0"
LIMIT_MS = 50.0

# The statement before the sweep: every candidate start scored by a per-node NOT EXISTS probe, the
# whole CTE materialised (it is referenced twice). Kept here as the reference answer for --check.
REFERENCE_SQL = """
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


def ensure_loaded(url: str, name: str, args) -> str:
    """Create and load the benchmark database unless it already holds this load; return its URL."""
    db_url = with_dbname(url, name)
    with psycopg.connect(**psycopg_kwargs(with_dbname(url, "postgres")), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    env = {**os.environ, "DATABASE_URL": db_url, "DJANGO_SETTINGS_MODULE": "portal.settings.dev"}
    manage(env, "migrate", "--no-input", "-v", "0")
    with psycopg.connect(**psycopg_kwargs(db_url)) as conn:
        nodes, allocations = conn.execute(
            "SELECT (SELECT count(*) FROM reservations_node n JOIN reservations_pool p ON p.id = n.pool_id "
            "        WHERE p.name LIKE 'scale-%%'),"
            "       (SELECT count(*) FROM reservations_allocation a JOIN reservations_node n ON n.id = a.node_id "
            "        JOIN reservations_pool p ON p.id = n.pool_id WHERE p.name LIKE 'scale-%%')").fetchone()
    if args.reseed or nodes != args.nodes or allocations != args.allocations:
        print(f"suggestions: loading {args.nodes} nodes / {args.allocations} allocations into {name} …", flush=True)
        manage(env, "seed_scale", "--nodes", str(args.nodes), "--allocations", str(args.allocations),
               "--days-back", str(args.days_back), "--replace")
    return db_url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--allocations", type=int, default=50_000)
    parser.add_argument("--days-back", type=int, default=20)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--reseed", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="Also run the pre-sweep statement once per request: same answers, its times.")
    parser.add_argument("--slot-minutes", type=int, default=0,
                        help="Time a pool of this slot length instead (see above); the scale load is left alone.")
    args = parser.parse_args()

    name = os.environ.get("BENCH_SUGGESTIONS_DB", "portal_suggestions")
    if args.slot_minutes:
        return short_slots(base_database_url(), name, args.slot_minutes)
    db_url = ensure_loaded(base_database_url(), name, args)
    os.environ.update({"DATABASE_URL": db_url, "DJANGO_SETTINGS_MODULE": "portal.settings.dev", "DEBUG": "false"})

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from reservations import selectors
    from reservations.choices import NodeState
    from reservations.models import Allocation, Pool
    from reservations.timeutil import slot_floor

    pool = Pool.objects.get(name=POOL)
    available = pool.nodes.filter(state=NodeState.AVAILABLE).count()
    now = timezone.now()
    earliest = slot_floor(now, pool.slot_minutes)
    latest_end = now + timedelta(days=settings.PORTAL_BOOKING_HORIZON_DAYS)
    search = timedelta(days=settings.PORTAL_SUGGESTION_SEARCH_DAYS)
    rng = random.Random(args.seed)

    # (label, node_count, start, end): refused requests, as _capacity_error sees them.
    requests: list[tuple[str, int, datetime, datetime]] = []
    while len(requests) < args.requests:
        start = earliest + timedelta(hours=rng.randint(24, 25 * 24))
        end = start + timedelta(hours=rng.choice([4, 8, 12, 24, 48]))
        free = len(selectors.free_node_ids(pool_id=pool.pk, start=start, end=end, limit=available))
        n = min(available, free + 1 + rng.randint(0, 200))
        if n > free:
            requests.append(("refused", n, start, end))
    start = earliest + timedelta(days=10)
    nothing = ("nothing fits", available, start, start + timedelta(hours=48))
    requests.append(nothing)

    def call(req):
        _, n, s, e = req
        return selectors.suggest_windows(pool=pool, node_count=n, start=s, end=e, earliest=earliest,
                                         latest_end=latest_end, search=search)

    answers = [call(r) for r in requests]  # warm-up, and the answers for --check
    if answers[-1]:
        sys.exit(f"suggestions: the nothing-fits request found {answers[-1]}; the load is not busy enough")
    found = sum(1 for a in answers[:-1] if a)
    times: list[float] = []
    for r in requests:
        t = time.perf_counter()
        call(r)
        times.append((time.perf_counter() - t) * 1000)
    t_nothing = [times[-1]]
    for _ in range(4):
        t = time.perf_counter()
        call(nothing)
        t_nothing.append((time.perf_counter() - t) * 1000)

    t_reference: list[float] = []
    if args.check:
        for r, got in zip(requests, answers, strict=True):
            _, n, s, e = r
            params = {"pool": pool.pk, "available": NodeState.AVAILABLE, "lo": max(earliest, s - search),
                      "hi": s + search, "slot_s": pool.slot_minutes * 60.0, "dur": e - s, "earliest": earliest,
                      "latest_end": latest_end, "start": s, "n": n}
            t = time.perf_counter()
            with connection.cursor() as cur:
                cur.execute(REFERENCE_SQL, params)
                starts = sorted(row[0] for row in cur.fetchall())
            t_reference.append((time.perf_counter() - t) * 1000)
            want = [{"start": x, "end": x + (e - s)} for x in starts]
            if got != want:
                sys.exit(f"suggestions: {r} answered {got}, the reference statement {want}")

    allocations = Allocation.objects.filter(node__pool=pool, active=True).count()
    print(f"suggestions — {pool.nodes.count()} nodes in {POOL} ({available} available), {allocations} active "
          f"allocations; {len(requests)} refused requests, {found} of {len(requests) - 1} with a suggestion "
          f"({platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {datetime.now(UTC):%Y-%m-%d})")

    def line(label, values):
        return (f"  {label:<46} p50 {percentile(values, 50):8.1f} ms   p95 {percentile(values, 95):8.1f} ms"
                f"   (n={len(values)})")

    print(line("suggest_windows, all requests", times))
    print(line("suggest_windows, nothing fits in ±60 days", t_nothing))
    if t_reference:
        print(line("reference: the pre-sweep statement (same answers)", t_reference))
    p95 = percentile(times, 95)
    verdict = "met" if p95 <= LIMIT_MS else "NOT met"
    print(f"ratio: suggest_windows p95 / limit = {p95 / LIMIT_MS:.2f} ({p95:.1f} ms against {LIMIT_MS:g} ms: "
          f"{verdict}; worst {max(times + t_nothing):.1f} ms)")
    return 0


def short_slots(url: str, name: str, slot_minutes: int) -> int:
    """--slot-minutes: the two refusals of a short-slot pool, each timed 5 times after a warm-up."""
    db_url = with_dbname(url, name)
    with psycopg.connect(**psycopg_kwargs(with_dbname(url, "postgres")), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    env = {**os.environ, "DATABASE_URL": db_url, "DJANGO_SETTINGS_MODULE": "portal.settings.dev"}
    manage(env, "migrate", "--no-input", "-v", "0")
    os.environ.update({"DATABASE_URL": db_url, "DJANGO_SETTINGS_MODULE": "portal.settings.dev", "DEBUG": "false"})

    import django

    django.setup()
    from django.conf import settings
    from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
    from django.utils import timezone

    from reservations import selectors, services
    from reservations.models import Allocation, Node, Pool
    from reservations.timeutil import slot_floor

    h = timedelta(hours=1)
    now = timezone.now()
    pool, _ = Pool.objects.get_or_create(name=f"bench-slots-{slot_minutes}", defaults={
        "gpu_model": "H100-SXM", "gpus_per_node": 8, "slot_minutes": slot_minutes})
    if not Allocation.objects.filter(node__pool=pool).exists():  # loaded once (dates relative to that day)
        print(f"suggestions: loading the {pool.name} pool …", flush=True)
        nodes = list(Node.objects.filter(pool=pool)) or Node.objects.bulk_create(
            Node(hostname=f"{pool.name}-{i}", pool=pool, state="available") for i in range(30))
        base = slot_floor(now, 60)
        Allocation.objects.bulk_create(
            (Allocation(node=node, period=DateTimeTZRange(t, t + h), kind="maintenance", note="bench")
             for i, node in enumerate(nodes)
             for t in (base - timedelta(days=62) + timedelta(minutes=24 * i) + 12 * h * k for k in range(250))),
            batch_size=2000)
        while services.slot_usage_compact():
            pass
    earliest = slot_floor(now, slot_minutes)
    latest_end = now + timedelta(days=settings.PORTAL_BOOKING_HORIZON_DAYS)
    search = timedelta(days=settings.PORTAL_SUGGESTION_SEARCH_DAYS)
    start = slot_floor(now, 60) + timedelta(days=1)
    cases = [("1 node for 24 h: nothing fits in ±60 days", 1, 24 * h),
             ("31 nodes of 30 for 4 h: never fits", 31, 4 * h)]
    print(f"suggestions — {pool.name}: 30 nodes, {slot_minutes}-minute slots "
          f"({platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {datetime.now(UTC):%Y-%m-%d})")
    for label, n, length in cases:
        def call(n=n, length=length):
            return selectors.suggest_windows(pool=pool, node_count=n, start=start, end=start + length,
                                             earliest=earliest, latest_end=latest_end, search=search)

        if call():
            sys.exit(f"suggestions: {label} found a window; the load is not what it should be")
        times = []
        for _ in range(5):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1000)
        print(f"  {label:<46} p50 {percentile(times, 50):8.1f} ms   worst {max(times):8.1f} ms   (n=5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
