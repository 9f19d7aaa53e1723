"""Fixtures for the ops tests: the ops middleware and event subscriber switched on, scrape helpers,
and throwaway Redis / PostgreSQL / Celery servers (see servers.py)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from portal.ops import metrics

from .servers import CeleryWorker, PostgresServer, RedisServer

OPS_MIDDLEWARE = ["portal.ops.logging.RequestIdMiddleware", "portal.ops.metrics.RequestMetricsMiddleware"]


@pytest.fixture
def ops(settings):
    """What the lead's base.py lines switch on: the ops middleware and the domain-event subscriber."""
    settings.MIDDLEWARE = [m for m in OPS_MIDDLEWARE if m not in settings.MIDDLEWARE] + list(settings.MIDDLEWARE)
    settings.PORTAL_METRICS_TOKEN = ""
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = ["127.0.0.0/8", "::1/128"]
    metrics.install()
    # Some ops tests point CELERY_BROKER_URL at a scratch Redis to read queue depths from it.
    # Celery binds its producer pool once, to the broker URL of the moment: bind it now, to
    # the session's broker, so a scratch URL can never become the broker of every later test.
    from portal.celery import app

    _ = app.amqp.producer_pool  # what apply_async publishes through: bound to a URL on first use
    return settings


class Scrape:
    """A parsed /metrics body: sample values by (name, labels)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(self, name: str, **labels) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def promtool_series(s: Scrape, minutes: int, *, prefix: str = "") -> list[dict[str, str]]:
    """A scrape's samples (those whose name starts with prefix) as promtool input series, each value held for
    minutes, beside the web target's up."""
    series = [{"series": 'up{instance="web:8000",job="portal"}', "values": f"1x{minutes}"}]
    for family in s.families.values():
        for sample in family.samples:
            if sample.name.startswith(prefix):
                labels = {**sample.labels, "job": "portal", "instance": "web:8000"}
                text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                series.append({"series": f"{sample.name}{{{text}}}", "values": f"{sample.value:g}x{minutes}"})
    return series


def scrape(client: Client | None = None, **headers) -> Scrape:
    client = client or Client()
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content[:500]
    return Scrape(response.content.decode())


def promtool_check(text: str) -> subprocess.CompletedProcess:
    """Run Prometheus' own linter over an exposition; it fails on format errors and lint problems."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `make system-deps` (Debian package prometheus)"
    return subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def celery_worker(redis_server) -> Iterator[CeleryWorker]:
    worker = CeleryWorker(redis_server.url).start()
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
