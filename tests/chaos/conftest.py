"""Fixtures for failures of real processes: a private Redis the test process and its workers share (restartable,
no persistence), and real Celery workers started against the test database."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.notify.conftest import book, notify_settings, receiver, webhook_for  # noqa: F401 - fixtures
from tests.provisioning.conftest import RedisServer, database_url, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def private_redis(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of our own (no persistence: a restart loses every message) that the test process's
    Celery app publishes to, as a web process would."""
    from portal.celery import app

    server = RedisServer(free_port(), tmp_path).start()
    saved = app.conf.broker_url, app._pool, app.amqp._producer_pool
    app.conf.broker_url = server.url
    app._pool = None
    app.amqp._producer_pool = None
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            if app._pool is not None:
                app._pool.force_close_all()
        app.conf.broker_url, app._pool, app.amqp._producer_pool = saved
        server.stop()


@dataclass
class Worker:
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_worker(log_dir: Path, redis_url: str, queues: str, *, settings_module: str = "tests.notify.worker_settings",
                 concurrency: int = 1, cache_redis_url: str | None = None, **env_extra: str) -> Worker:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings_module,
        "DATABASE_URL": database_url(),
        "REDIS_URL": cache_redis_url or redis_url,
        "CELERY_BROKER_URL": redis_url,
        "PYTHONUNBUFFERED": "1",
        **env_extra,
    }
    log = log_dir / f"worker-{uuid.uuid4().hex[:8]}.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queues, "-c", str(concurrency),
             "-P", "prefork", "-l", "info", "-n", f"chaos-{uuid.uuid4().hex[:6]}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )
    worker = Worker(proc, log)
    wait_for(lambda: " ready." in worker.output() or proc.poll() is not None, timeout=60, what="worker ready")
    if proc.poll() is not None:
        raise RuntimeError(f"worker exited {proc.returncode}:\n{worker.output()[-4000:]}")
    return worker
