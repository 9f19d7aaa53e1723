#!/usr/bin/env python
"""Health-check sweep: 10,000 simulated 8-GPU nodes through Celery into the database, against
the same checks in an in-process loop (the limit).

**Celery side**: ``health_sweep()`` exactly as the beat runs it: one INSERT … SELECT queues a
quick check per node, ``dispatch`` sends them in batches of PORTAL_HEALTH_FLEET_BATCH to the
fleet queue over the real Redis broker, and a real ``celery worker`` (``-c`` processes, the
fleet simulator of ``python -m provisioning.health.worker fleet``) builds each node's FakeNvml
from PORTAL_FAKE_NVML, runs the quick level (NVML checks of 8 GPUs, XID events and kernel log),
compacts the report and stores each batch with one UPDATE; failing nodes are drained, get a
repair and their bookings are moved. Timed from the sweep call until no check is open.

**Limit side**: the same ``SimulatedFleet.run`` per node (fake construction, run_checks, compact)
in a loop with no broker and no database, in one process and in ``-c`` processes (the worker's
parallelism) — the ratio uses the latter, so it measures what Celery and PostgreSQL cost, not
how many cores there are.

    .venv/bin/python bench/health_sweep.py [--nodes 10000] [--concurrency N] [--batch 50]

It uses a scratch database ``portal_health_bench`` on the dev server (DATABASE_URL, else the
embedded one), recreated each run, and a queue of its own on the dev Redis.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, base_database_url, manage, private_redis_url, recreate_database  # noqa: E402

DB_NAME = "portal_health_bench"
MODEL, GPUS = "H100-SXM", 8


def fleet_spec(nodes: int) -> dict:
    """A realistic fleet: 1 % of nodes warn (persistence off, a hot GPU), 0.1 % fail (ECC, NVLink)."""
    faults: dict[str, list] = {}
    for i in range(1, nodes + 1):
        host = f"bench-{i:05d}"
        if i % 1000 == 7:
            faults[host] = [{"kind": "ecc_uncorrected", "gpu": i % GPUS}] if (i // 1000) % 2 else [
                {"kind": "nvlink_down", "gpu": i % GPUS, "link": 3}]
        elif i % 100 == 3:
            faults[host] = [{"kind": "persistence_off", "gpu": 0}] if i % 2 else [{"kind": "hot", "gpu": 2}]
    return {"default": {}, "nodes": faults}


def _jobs(nodes: int) -> list[dict]:
    return [{"id": i, "host": f"bench-{i:05d}", "level": "quick", "model": MODEL, "gpus": GPUS, "idle": True,
             "peers": [], "pins": {}, "detail": "compact", "heal": None} for i in range(1, nodes + 1)]


_FLEET = None


def _loop_chunk(args: tuple[str, list[dict]]) -> dict[str, int]:
    global _FLEET
    spec, jobs = args
    if _FLEET is None:
        from provisioning.health.runner import SimulatedFleet

        _FLEET = SimulatedFleet(spec)
    counts: dict[str, int] = {}
    for job in jobs:
        verdict = _FLEET.run(job, event_wait_ms=0)["verdict"]
        counts[verdict] = counts.get(verdict, 0) + 1
    return counts


def in_process_loop(spec: str, nodes: int, processes: int) -> tuple[float, dict[str, int]]:
    """Run every node's checks without broker or database; return (nodes per second, verdicts)."""
    jobs = _jobs(nodes)
    chunks = [(spec, jobs[i:i + 50]) for i in range(0, len(jobs), 50)]
    started = time.perf_counter()
    if processes == 1:
        results = [_loop_chunk(chunk) for chunk in chunks]
    else:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            results = pool.map(_loop_chunk, chunks, chunksize=1)
    elapsed = time.perf_counter() - started
    totals: dict[str, int] = {}
    for counts in results:
        for verdict, n in counts.items():
            totals[verdict] = totals.get(verdict, 0) + n
    return nodes / elapsed, totals


def start_worker(env: dict, queue: str, concurrency: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queue, "-c", str(concurrency),
         "-n", f"bench-{queue}@%h", "-l", "info", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if " ready." in line:
            break
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the Celery worker did not start")
    # Keep draining its output so the pipe never blocks the worker.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args()

    spec = json.dumps(fleet_spec(args.nodes))
    db_url = recreate_database(base_database_url(), DB_NAME)
    queue = f"fleet-bench-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ, "DATABASE_URL": db_url,
        "REDIS_URL": (_redis := private_redis_url()), "CELERY_BROKER_URL": _redis,
        "DJANGO_SETTINGS_MODULE": "portal.settings.dev",
        "PORTAL_FAKE_NVML": spec, "PORTAL_HEALTH_FLEET_QUEUE": queue, "PORTAL_HEALTH_FLEET_BATCH": str(args.batch),
        "PORTAL_HEALTH_AGENT_QUEUE": "fleet", "LOG_LEVEL": "WARNING",
    }
    manage(env, "migrate", "--no-input", "-v", "0")
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection
    from django.db.models import Count

    from provisioning.health.models import HealthCheck, Repair
    from provisioning.health.services import health_sweep
    from reservations.models import Node, Pool

    pool = Pool.objects.create(name="bench", gpu_model=MODEL, gpus_per_node=GPUS)
    Node.objects.bulk_create([Node(hostname=f"bench-{i:05d}", pool=pool) for i in range(1, args.nodes + 1)],
                             batch_size=5000)
    print(f"{args.nodes} nodes × {GPUS} GPUs ({MODEL}); worker and loop with {args.concurrency} processes; "
          f"{os.cpu_count()} CPUs", flush=True)

    connection.close()  # the loop's processes are forked: no shared database connection
    loop1_rate, _ = in_process_loop(spec, min(args.nodes, 2000), 1)
    print(f"in-process loop, 1 process:  {loop1_rate:8.1f} nodes/s (first {min(args.nodes, 2000)} nodes)", flush=True)
    loop_rate, loop_verdicts = in_process_loop(spec, args.nodes, args.concurrency)
    print(f"in-process loop, {args.concurrency} processes: {loop_rate:8.1f} nodes/s  verdicts {loop_verdicts}",
          flush=True)

    worker = start_worker(env, queue, args.concurrency)
    try:
        connection.close()
        started = time.perf_counter()
        ids = health_sweep()
        queued = time.perf_counter() - started
        while HealthCheck.objects.filter(status__in=["queued", "running"]).exists():
            time.sleep(0.5)
        elapsed = time.perf_counter() - started
    finally:
        worker.terminate()
        worker.wait(60)
    rate = len(ids) / elapsed
    verdicts = dict(HealthCheck.objects.values_list("verdict").annotate(n=Count("id")).order_by())
    with connection.cursor() as cur:
        cur.execute("SELECT pg_total_relation_size('health_healthcheck')")
        table_bytes = cur.fetchone()[0]
    print(f"through Celery into PostgreSQL: {rate:8.1f} nodes/s  ({len(ids)} checks in {elapsed:.1f} s; "
          f"queued and sent in {queued:.2f} s)  verdicts {verdicts}", flush=True)
    print(f"stored: {table_bytes / len(ids) / 1024:.1f} KiB per check (table and indexes); "
          f"{Repair.objects.count()} repairs opened, {Node.objects.filter(state='draining').count()} nodes drained")
    assert verdicts == loop_verdicts, (verdicts, loop_verdicts)
    ratio = rate / loop_rate
    print(f"ratio: Celery sweep / in-process loop = {ratio:.2f} (goal ≥ 0.50: {'met' if ratio >= 0.5 else 'NOT met'}); "
          f"vs a 1-process loop {rate / loop1_rate:.2f}")


if __name__ == "__main__":
    main()
