"""Fixtures for failures of real processes: a private Redis the test process and its workers share (restartable,
no persistence), and real Celery workers started against the test database."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.notify.conftest import book, notify_settings, receiver, webhook_for  # noqa: F401 - fixtures
from tests.provisioning.conftest import RedisServer, Worker, free_port, wait_for  # noqa: F401 - wait_for for the tests
from tests.provisioning.conftest import start_worker as start_provisioning_worker

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


def start_worker(log_dir: Path, redis_url: str, queues: str, *, settings_module: str = "tests.notify.worker_settings",
                 concurrency: int = 1, cache_redis_url: str | None = None, **env_extra: str) -> Worker:
    """A real worker on queues with redis_url as its broker (the private, restartable Redis)."""
    return start_provisioning_worker(log_dir, redis_url=redis_url, queues=queues, settings_module=settings_module,
                                     concurrency=concurrency, cache_redis_url=cache_redis_url, name="chaos",
                                     **env_extra)
