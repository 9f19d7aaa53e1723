#!/usr/bin/env python
"""Availability at scale: the API against the best hand-written SQL for the same answer, same run.

    python bench/availability.py [--nodes 10000] [--allocations 1000000] [--runs 30] [--reseed]

What it does:

1. Creates the database ``portal_scale`` (``BENCH_SCALE_DB``) next to the database of
   ``DATABASE_URL`` (else the embedded server of var/dev.env), migrates it and loads
   ``manage.py seed_scale --nodes N --allocations M`` once (reused while the counts match).
2. Starts gunicorn from gunicorn.conf.py (one sync worker, DEBUG off) on a loopback port and asks
   ``GET /api/v1/availability/?pool=scale-p0&start=…&end=…+14d&step=3600`` over HTTP with a
   bearer token: 336 hourly slots of one 10,000-node pool. That is the API figure.
3. Times the hand-written SQL below for the same question through psycopg (no Django), checks it
   returns exactly the API's slots, and prints p50/p95 for both and their ratio. The per-slot
   summary is compacted first, as the beat task keeps it in production.

Also printed, for the record: reservations.selectors.availability called in-process (Django cursor),
and one /metrics scrape over the same data.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlencode, urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
POOL = "scale-p0"
GOAL_SQL_MS = 20.0
GOAL_RATIO = 2.0

# --- the SQL ------------------------------------------------------------------------------
#
# The "hand-written SQL" is the best statement we know for the answer: for hourly slots of an
# hourly pool, reservations.selectors.AVAILABILITY_SUMMARY_SQL — the slot series left-joined to the
# per-slot busy counts the triggers maintain (PoolSlotUsage + pending PoolSlotUsageDelta, migration
# 0006), minus the pool's available nodes: ~336 index lookups, however many allocations there are.
# It is executed here straight through psycopg with no Django in the way — the floor the API is
# measured against. (Other windows — wider steps, off-grid starts — take the selector's sweep,
# AVAILABILITY_GRID_SQL / AVAILABILITY_EXACT_SQL; the benchmark's question never does, and
# main() checks that.)


def hand_availability(cursor, *, pool_id: int, start: datetime, end: datetime, step: timedelta) -> list[tuple]:
    """Return [(slot start, slot end, free nodes)] by running the selector's SQL on a plain cursor."""
    from reservations.selectors import availability_rows

    return availability_rows(cursor, pool_id=pool_id, start=start, end=end, step=step)


class _Recorder:
    """A cursor that remembers the statements it ran."""

    def __init__(self, cursor) -> None:
        self.cursor, self.statements = cursor, []

    def execute(self, sql, params=None):
        self.statements.append(sql)
        return self.cursor.execute(sql, params)

    def fetchall(self):
        return self.cursor.fetchall()


# --- plumbing -------------------------------------------------------------------------------


def database_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        env_file = ROOT / "var" / "dev.env"
        if env_file.exists():
            for line in env_file.read_text().splitlines():
                if line.startswith("DATABASE_URL="):
                    url = line.split("=", 1)[1].strip()
    if not url:
        sys.exit("availability: no DATABASE_URL and no var/dev.env; run `make services` first")
    return url


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def ensure_database(url: str, name: str) -> None:
    import psycopg

    # libpq understands postgres:// URIs, including a percent-encoded Unix-socket directory as host.
    with psycopg.connect(with_db(url, "postgres"), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def measure(fn, *, runs: int, budget_s: float, warmup: int = 2) -> list[float]:
    """Call fn warmup times, then up to runs times (at least 3, within budget_s); return ms per call."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    started = time.monotonic()
    while len(times) < runs and (len(times) < 3 or time.monotonic() - started < budget_s):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return times


def line(label: str, times: list[float]) -> str:
    return (f"  {label:<46} p50 {percentile(times, 0.5):9.1f} ms   p95 {percentile(times, 0.95):9.1f} ms"
            f"   (n={len(times)})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """gunicorn from gunicorn.conf.py, one sync worker, on a loopback port."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="bench-gunicorn-", suffix=".log", delete=False)
        env = {**env, "WEB_CONCURRENCY": "1", "GUNICORN_BIND": f"127.0.0.1:{self.port}", "GUNICORN_TIMEOUT": "300"}
        self.proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py",
                                      "portal.wsgi:application"], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.get("/healthz")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"availability: gunicorn did not start:\n{Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.2)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("GET", path, headers={"Host": "127.0.0.1", **(headers or {})})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        Path(self.log.name).unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--allocations", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=14)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--budget", type=float, default=60.0, help="Seconds per measured path, at most.")
    parser.add_argument("--reseed", action="store_true")
    args = parser.parse_args()

    name = os.environ.get("BENCH_SCALE_DB", "portal_scale")
    base_url = database_url()
    ensure_database(base_url, name)
    scale_url = with_db(base_url, name)
    os.environ.update({"DATABASE_URL": scale_url, "DJANGO_SETTINGS_MODULE": "portal.settings.dev", "DEBUG": "false",
                       "PORTAL_THROTTLE_USER": "10000000/min"})

    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from reservations.models import Allocation, Node, Pool
    from reservations.timeutil import slot_floor
    from tenants.services import token_issue

    call_command("migrate", verbosity=0)
    pool = Pool.objects.filter(name=POOL).first()
    seeded = (pool is not None and Node.objects.filter(pool__name__startswith="scale-").count() == args.nodes
              and Allocation.objects.filter(node__pool__name__startswith="scale-").count() == args.allocations)
    if args.reseed or not seeded:
        print(f"availability: loading {args.nodes} nodes / {args.allocations} allocations into {name} …",
              flush=True)
        call_command("seed_scale", nodes=args.nodes, allocations=args.allocations, replace=True)
        pool = Pool.objects.get(name=POOL)
    from django.contrib.auth import get_user_model

    from reservations.services import slot_usage_compact

    user, _ = get_user_model().objects.get_or_create(username="scale-bench", defaults={"is_staff": True})
    token = token_issue(user=user)[1]
    slot_usage_compact()
    connection.close()

    start = slot_floor(datetime.now(UTC), pool.slot_minutes)
    end = start + timedelta(days=args.days)
    step = timedelta(seconds=3600)
    query = urlencode({"pool": POOL, "start": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "end": end.strftime("%Y-%m-%dT%H:%M:%SZ"), "step": 3600})
    auth = {"Authorization": f"Bearer {token}"}

    import psycopg

    from reservations import selectors

    sql_conn = psycopg.connect(scale_url, autocommit=True)
    cur = sql_conn.cursor()
    recorder = _Recorder(cur)
    hand = hand_availability(recorder, pool_id=pool.pk, start=start, end=end, step=step)
    if recorder.statements != [selectors.AVAILABILITY_SUMMARY_SQL]:
        sys.exit("availability: the hand SQL did not answer from the per-slot summary alone")
    pending = cur.execute("SELECT count(*) FROM reservations_poolslotusagedelta").fetchone()[0]
    usage_rows = cur.execute("SELECT count(*) FROM reservations_poolslotusage WHERE pool_id = %s",
                             [pool.pk]).fetchone()[0]

    server = Server(dict(os.environ))
    try:
        status, body = server.get(f"/api/v1/availability/?{query}", auth)
        if status != 200:
            sys.exit(f"availability: API answered {status}: {body[:300]!r}")
        api = json.loads(body)
        api_slots = [(s["start"], s["end"], s["free_nodes"]) for s in api["slots"]]
        hand_slots = [(a.strftime("%Y-%m-%dT%H:%M:%SZ"), b.strftime("%Y-%m-%dT%H:%M:%SZ"), f) for a, b, f in hand]
        if api_slots != hand_slots:
            diff = next(i for i, (x, y) in enumerate(zip(api_slots, hand_slots, strict=False)) if x != y)
            sys.exit(f"availability: API and hand SQL disagree at slot {diff}: {api_slots[diff]} vs {hand_slots[diff]}")

        t_sql = measure(lambda: hand_availability(cur, pool_id=pool.pk, start=start, end=end, step=step),
                        runs=args.runs, budget_s=args.budget)
        t_api = measure(lambda: server.get(f"/api/v1/availability/?{query}", auth), runs=args.runs,
                        budget_s=args.budget)
        t_selector = measure(lambda: selectors.availability(pool=pool, start=start, end=end, step=step),
                             runs=args.runs, budget_s=args.budget, warmup=1)
        t_metrics = measure(lambda: server.get("/metrics"), runs=5, budget_s=args.budget, warmup=1)
        # For the record, what the ratio is made of: the fixed cost of any authenticated API
        # request (token, throttle, pool lookup, error envelope: an unknown pool answers 400) and
        # the sweep over the allocations that the summary replaced.
        bad = urlencode({"pool": "no-such-pool", "step": 3600})
        if server.get(f"/api/v1/availability/?{bad}", auth)[0] != 400:
            sys.exit("availability: an unknown pool did not answer 400")
        t_floor = measure(lambda: server.get(f"/api/v1/availability/?{bad}", auth), runs=args.runs,
                          budget_s=args.budget)
        sweep_params = {"pool": pool.pk, "start": start, "end": end, "step_s": step.total_seconds(),
                        "n": math.ceil((end - start) / step)}
        t_sweep = measure(lambda: cur.execute(selectors.AVAILABILITY_GRID_SQL, sweep_params).fetchall(),
                          runs=min(args.runs, 10), budget_s=args.budget)
    finally:
        server.stop()
        sql_conn.close()

    counts = f"{Node.objects.filter(pool=pool).count()} nodes in {POOL}, {Allocation.objects.count()} allocations"
    print(f"availability — {counts}; {len(hand)} hourly slots over {args.days} days "
          f"({platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {datetime.now(UTC):%Y-%m-%d})")
    print(f"  per-slot summary: {usage_rows} rows for {POOL}, {pending} pending deltas at the start")
    print(line("hand SQL (psycopg, the per-slot summary)", t_sql))
    print(line("API GET /api/v1/availability/ (HTTP, gunicorn)", t_api))
    print(line("reservations.selectors.availability alone", t_selector))
    print(line("GET /metrics over the same data", t_metrics))
    print(line("API floor: authenticated 400 (unknown pool)", t_floor))
    print(line("sweep SQL over the allocations (no summary)", t_sweep))
    p50_ratio = percentile(t_api, 0.5) / percentile(t_sql, 0.5)
    p95_ratio = percentile(t_api, 0.95) / percentile(t_sql, 0.95)
    sql_ok = "met" if percentile(t_sql, 0.5) <= GOAL_SQL_MS else "NOT met"
    api_ok = "met" if p50_ratio <= GOAL_RATIO else "NOT met"
    print(f"ratio: availability API / hand SQL = {p50_ratio:.2f} at p50, {p95_ratio:.2f} at p95 "
          f"(goal ≤ {GOAL_RATIO:g}: {api_ok}; hand SQL p50 {percentile(t_sql, 0.5):.1f} ms, goal ≤ {GOAL_SQL_MS:g} ms: "
          f"{sql_ok}; mean API {statistics.fmean(t_api):.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
