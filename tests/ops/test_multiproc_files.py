"""Prometheus multiprocess files under gunicorn stay bounded while workers are recycled.

gunicorn.conf.py sets ``max_requests``, so workers are replaced all the time; each writes
``counter_<pid>.db`` and ``histogram_<pid>.db`` and every scrape merges the whole directory. The
master folds a dead worker's counters into one archive file per type (gunicorn.conf.py's
``child_exit``), so the directory holds the live workers' files plus the archives, and the totals
still count every request a dead worker answered.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import values as prometheus_values

from portal.ops import multiproc
from tests.dburl import database_url

from .conftest import Scrape, promtool_check
from .servers import free_port
from .test_production import _get, production_env

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    """The live worker processes of a gunicorn master (from /proc: no psutil needed)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def _file_pids(directory: Path) -> set[str]:
    return {p.name.rsplit("_", 1)[-1].removesuffix(".db") for p in directory.glob("*.db")}


@pytest.mark.django_db
def test_recycled_workers_leave_no_files_behind_and_lose_no_counts(tmp_path, redis_server):
    port = free_port()
    prom = tmp_path / "prom"
    token = "scrape-me-" + secrets.token_hex(8)
    (tmp_path / "token").write_text(token)
    env = production_env(
        DATABASE_URL=database_url(), REDIS_URL=redis_server.url, CELERY_BROKER_URL=redis_server.url,
        PORT=str(port), WEB_CONCURRENCY="2", PROMETHEUS_MULTIPROC_DIR=str(prom),
        PORTAL_METRICS_TOKEN_FILE=str(tmp_path / "token"), GUNICORN_BIND=f"127.0.0.1:{port}",
    )
    log = tmp_path / "gunicorn.log"
    # The command line overrides gunicorn.conf.py: a worker is recycled after every 3 requests.
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--max-requests", "3",
         "--max-requests-jitter", "0", "portal.wsgi:application"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    probes = 36
    try:
        deadline = time.monotonic() + 60
        answered = 0
        while answered < probes:
            try:
                status, _, _ = _get(port, "/healthz")
            except OSError:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
                continue
            assert status == 200
            answered += 1
        # Wait until the master has reaped the recycled workers and the live ones have written their files.
        deadline = time.monotonic() + 30
        while True:
            live = {str(pid) for pid in _children(proc.pid)}
            pids = _file_pids(prom)
            if (len(live) == 2 and pids - live <= {"archive"}) or time.monotonic() > deadline:
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        # 36 requests at 3 per worker: at least ten workers came and went.
        assert log.read_text().count("Booting worker with pid") >= 2 + 10
        assert pids - live <= {"archive"}, f"files of dead workers left: {sorted(pids - live)}"
        assert len(list(prom.glob("*.db"))) <= 2 * (len(live) + 1)

        status, _, body = _get(port, "/metrics", {"Authorization": f"Bearer {token}"})
        assert status == 200, body[:500]
        scrape = Scrape(body.decode())
        # Every probe counted once, whichever (long gone) worker answered it.
        assert scrape.value("portal_http_requests_total", method="GET", view="ops-healthz", status="200") == probes
        assert scrape.value("portal_http_request_duration_seconds_count", method="GET", view="ops-healthz") == probes
        assert scrape.value("portal_http_request_duration_seconds_bucket", method="GET", view="ops-healthz",
                            le="+Inf") == probes
        assert scrape.value("portal_booking_requests_total", outcome="created") == 0
        result = promtool_check(scrape.text)
        assert result.returncode == 0, (result.stdout + result.stderr).decode()
    finally:
        proc.terminate()
        proc.wait(30)


def _worker_metrics(path: Path):
    """A fresh set of multiprocess-backed metrics, as a new worker process would create them."""
    registry = CollectorRegistry()
    counter = Counter("race_requests", "Requests.", ["view"], registry=registry)
    histogram = Histogram("race_seconds", "Latency.", ["view"], buckets=(0.1, 1.0), registry=registry)
    return counter, histogram


def test_scrapes_never_see_a_half_folded_dead_worker(tmp_path, monkeypatch):
    """One thread plays the gunicorn master folding dead workers' files into the archive while
    another scrapes: a scrape sees each dead worker's counts exactly once, never twice (its file and
    the archive) and never zero times (between the two), so the counter never goes backwards."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    workers = 40
    # Each "worker" counts 5 requests in a file of its own pid, like a recycled gunicorn worker.
    for fake_pid in range(1000, 1000 + workers):
        monkeypatch.setattr(prometheus_values, "ValueClass", prometheus_values.MultiProcessValue(lambda p=fake_pid: p))
        counter, histogram = _worker_metrics(tmp_path)
        for _ in range(5):
            counter.labels("home").inc()
            histogram.labels("home").observe(0.5)
    expected = 5 * workers
    seen: list[tuple[float, float]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def scrape():
        try:
            while not done.is_set():
                families = {m.name: m for m in multiproc.collect(str(tmp_path))}
                total = next(s.value for s in families["race_requests"].samples if s.name == "race_requests_total")
                count = next(s.value for s in families["race_seconds"].samples if s.name == "race_seconds_count")
                seen.append((total, count))
                time.sleep(0.001)  # like real scrapes, leave the master a moment to take the lock
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    readers = [threading.Thread(target=scrape) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for fake_pid in range(1000, 1000 + workers):
            multiproc.mark_process_dead(fake_pid, str(tmp_path))
            time.sleep(0.002)
    finally:
        done.set()
        for t in readers:
            t.join(30)
    assert not errors, errors
    assert len(seen) > workers
    assert seen and all(pair == (expected, expected) for pair in seen), sorted(set(seen))
    assert sorted(p.name for p in tmp_path.glob("*.db")) == ["counter_archive.db", "histogram_archive.db"]
    families = {m.name: m for m in multiproc.collect(str(tmp_path))}
    buckets = {s.labels["le"]: s.value for s in families["race_seconds"].samples if s.name == "race_seconds_bucket"}
    assert buckets == {"0.1": 0, "1.0": expected, "+Inf": expected}
    assert next(s.value for s in families["race_seconds"].samples if s.name == "race_seconds_sum") == 0.5 * expected
    assert os.listdir(tmp_path)  # the lock file stays; it is no *.db, so no scrape reads it
