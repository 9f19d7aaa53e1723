"""Readiness checks for /readyz: PostgreSQL (reachable, every migration of this code applied), Redis
and a Celery worker, each with a short timeout.

Every check opens its own short-lived connection from the *current* settings instead of using the
request's pooled one, so a probe measures whether the service answers now (and a wedged server
costs at most the timeout, never a hung web worker).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import connections

__all__ = ["CheckResult", "MigrationsPending", "check_database", "check_migrations", "check_redis", "check_celery",
           "readiness"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    seconds: float
    error: str = ""

    def as_dict(self) -> dict:
        out = {"ok": self.ok, "ms": round(self.seconds * 1000, 1)}
        if self.error:
            out["error"] = self.error
        return out


def _timeout() -> float:
    return float(getattr(settings, "PORTAL_READYZ_TIMEOUT", 2.0))


def _timed(name: str, fn) -> CheckResult:
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # any failure means "not ready"; the class name is enough for the probe
        logger.warning("readyz: %s check failed: %s", name, exc, exc_info=False)
        return CheckResult(False, time.perf_counter() - started, exc.__class__.__name__)
    return CheckResult(True, time.perf_counter() - started)


class MigrationsPending(Exception):
    """The database lacks migrations this code ships (`manage.py migrate` has not run for this release)."""


def _fresh_connection(alias: str):
    """A new connection wrapper with the alias's current settings, the probe's timeouts on it."""
    params = dict(settings.DATABASES[alias])
    options = dict(params.get("OPTIONS") or {})
    options["connect_timeout"] = max(1, int(round(_timeout())))
    params["OPTIONS"] = options
    # configure_settings fills in the defaults Django itself would (TIME_ZONE, TEST, …).
    configured = connections.configure_settings({alias: params})[alias]
    wrapper = connections[alias].__class__(configured, alias)
    try:
        with wrapper.cursor() as cur:
            cur.execute("SELECT set_config('statement_timeout', %s, false)", [str(int(_timeout() * 1000))])
    except BaseException:
        wrapper.close()
        raise
    return wrapper


def check_database(alias: str = "default") -> CheckResult:
    """Open a fresh connection with the alias's current settings and run SELECT 1."""

    def probe() -> None:
        wrapper = _fresh_connection(alias)
        try:
            with wrapper.cursor() as cur:
                cur.execute("SELECT 1")
                cur.fetchone()
        finally:
            wrapper.close()

    return _timed("database", probe)


@functools.cache
def _shipped_migrations() -> tuple[tuple[tuple[str, str], frozenset], ...]:
    """Every migration of the running code, with the ones each squashes: read from disk once per process."""
    from django.db.migrations.loader import MigrationLoader

    graph = MigrationLoader(None, ignore_no_migrations=True).graph
    return tuple((key, frozenset(graph.nodes[key].replaces or ())) for key in sorted(graph.nodes))


def check_migrations(alias: str = "default") -> CheckResult:
    """Every migration of the running code is applied. A web started on a new image before `migrate`
    finished (a rolling deploy, `docker compose up -d web`) would answer 500s on every table or column
    the release adds: it is not ready until the schema is the code's.

    The applied ones are read on the probe's own connection (MigrationRecorder would read them through
    the alias's pooled connection, without the probe's timeouts)."""

    def probe() -> None:
        wrapper = _fresh_connection(alias)
        try:
            with wrapper.cursor() as cur:
                applied: set = set()
                if "django_migrations" in wrapper.introspection.table_names(cur):
                    cur.execute("SELECT app, name FROM django_migrations")
                    applied = set(cur.fetchall())
        finally:
            wrapper.close()
        missing = [key for key, replaces in _shipped_migrations()
                   if key not in applied and not (replaces and replaces <= applied)]
        if missing:
            raise MigrationsPending(f"{len(missing)} migration(s) not applied, among them {'.'.join(missing[0])}")

    return _timed("migrations", probe)


def check_redis() -> CheckResult:
    """PING the cache Redis (REDIS_URL)."""
    import redis

    def probe() -> None:
        timeout = _timeout()
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()

    return _timed("redis", probe)


def check_celery() -> CheckResult:
    """Broadcast a ping on the broker (CELERY_BROKER_URL) and wait for the first worker to answer."""

    def probe() -> None:
        import redis

        timeout = _timeout()
        url = getattr(settings, "CELERY_BROKER_URL", None) or settings.REDIS_URL
        if url.startswith(("redis://", "rediss://", "unix://")):
            # Fail fast when the broker is down: kombu would otherwise retry connecting.
            client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
            try:
                client.ping()
            finally:
                client.close()
        replies = _probe_app(url).control.ping(timeout=timeout, limit=1)
        if not replies:
            raise TimeoutError(f"no Celery worker answered within {timeout:g} s")

    # A broker that accepts the connection but never answers must not hold the probe longer: the
    # pool is left without waiting for its thread (a `with` block would join it, hang and all).
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        future = pool.submit(_timed, "celery", probe)
        return future.result(timeout=_timeout() * 3)
    except concurrent.futures.TimeoutError:
        return CheckResult(False, _timeout() * 3, "TimeoutError")
    finally:
        pool.shutdown(wait=False)


_probe_apps: dict[str, object] = {}


def _probe_app(url: str):
    """A bare Celery app on url, only for control pings (cached per broker URL).

    ``portal.celery.app.control.ping(connection=...)`` would still publish through the app's
    own producer pool, i.e. to the broker configured at import time, not the one asked for.
    """
    app = _probe_apps.get(url)
    if app is None:
        from celery import Celery

        app = Celery("portal-readyz", broker=url, set_as_current=False)
        app.conf.broker_connection_retry_on_startup = False
        app.conf.broker_connection_max_retries = 0
        _probe_apps[url] = app
    return app


def readiness() -> dict[str, CheckResult]:
    """Run every readiness check; the service is ready when all are ok."""
    database = check_database()
    migrations = check_migrations() if database.ok else CheckResult(False, 0.0, "DatabaseUnavailable")
    return {"database": database, "migrations": migrations, "redis": check_redis(), "celery": check_celery()}
