"""Fixtures for the notifications app: the loopback receiver (tests/notifications), channels, bookings.

Service-level tests call the services the Celery tasks call (``event_fanout``,
``delivery_send``) against the real PostgreSQL, Redis and a real HTTP receiver; the worker
module (test_worker.py) runs the same through a real Celery worker process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.db.models import F

from notifications import ratelimit, services
from notifications.models import Channel, Delivery, DeliveryAttempt
from reservations import services as booking
from tenants.services import tenant_slack_webhook_set
from tests.notifications.receiver import WebhookReceiver


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    """The real loopback webhook receiver of tests/notifications, answering 200 ok unless scripted.

    On teardown it frees the one-per-interval send slots (notifications.ratelimit) of every URL
    it handed out or was posted to: the slots live in the shared Redis, keyed by the full URL
    (random port included), and would otherwise make the next test's first send wait if its
    receiver happened to get the same port within the interval.
    """
    server = WebhookReceiver().start()
    handed_out: set[str] = set()
    real_url = server.url

    def url(path: str = "/hook") -> str:
        full = real_url(path)
        handed_out.add(full)
        return full

    server.url = url  # type: ignore[method-assign]
    try:
        yield server
    finally:
        server.stop()
        _free_send_slots(handed_out | {server.base_url + request.path for request in server.requests})


def _free_send_slots(urls: set[str]) -> None:
    """Delete the rate-limit slots notifications.services.delivery_send takes for these URLs."""
    if not urls:
        return
    client = ratelimit.client_from_url(django_settings.REDIS_URL)  # the Redis services._redis() talks to
    try:
        client.delete(*(ratelimit.key_for_url(url) for url in urls))
    finally:
        client.close()


@pytest.fixture
def notify_settings(settings):
    """Short timeouts and backoff so retries happen within a test."""
    settings.PORTAL_BASE_URL = "https://portal.example.com"
    settings.PORTAL_NOTIFY_HTTP_TIMEOUT = 2.0
    settings.PORTAL_NOTIFY_BACKOFF_BASE = 0.2
    settings.PORTAL_NOTIFY_BACKOFF_CAP = 2.0
    settings.PORTAL_NOTIFY_MIN_INTERVAL = 1.0
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = ""
    settings.PORTAL_DEMO_WEBHOOK_URL = ""
    return settings


@pytest.fixture
def slack_for(world, notify_settings):
    """Give a tenant a Slack webhook URL (on the tenant, as leads set it); return its channel row."""

    def _slack(slug: str, url: str, events: list[str] | None = None) -> Channel:
        tenant = tenant_slack_webhook_set(actor=world.users[f"{slug}-lead"], tenant=world.tenants[slug], url=url)
        world.tenants[slug] = tenant
        channel = services.slack_channel_ensure(tenant)
        if events is not None:
            channel = services.slack_subscriptions_update(actor=world.users[f"{slug}-lead"], tenant=tenant,
                                                          events=events)
        return channel

    return _slack


@pytest.fixture
def webhook_for(world, notify_settings):
    """Register a signed webhook for a tenant; return (channel, secret)."""

    def _webhook(slug: str, url: str, events: list[str] | None = None) -> tuple[Channel, str]:
        return services.webhook_create(actor=world.users[f"{slug}-lead"], tenant=world.tenants[slug], url=url,
                                       name="ci", events=events)

    return _webhook


@pytest.fixture
def book(world):
    """Book through the real service: book("alpha", t0, hours=2, nodes=1)."""

    def _book(slug: str, start, *, hours: int = 2, nodes: int = 1, name: str = ""):
        return booking.reservation_create(
            actor=world.users[f"{slug}-lead"], tenant=world.tenants[slug], pool=world.pool, node_count=nodes,
            start=start, end=start + timedelta(hours=hours), name=name or f"{slug}-run",
        )

    return _book


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_receiver_command(log: Path, **env: str) -> tuple[subprocess.Popen, int]:
    """Run `manage.py notifications_receiver` on a free port with env on top of ours; wait until it listens.

    Its output goes to log. Returns the process (the caller terminates it) and its port.
    """
    port = free_port()
    full_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings.test", "PYTHONUNBUFFERED": "1", **env}
    with log.open("wb") as out:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [sys.executable, "manage.py", "notifications_receiver", "--port", str(port)],
            cwd=Path(__file__).resolve().parents[2], env=full_env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while "Listening" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc, port


def let_time_pass(delivery_id: int, seconds: float) -> None:
    """Let `seconds` go by for one delivery without sleeping: everything it recorded (made, attempted, next due,
    and its attempts' times) moves that far into the past."""
    shift = timedelta(seconds=seconds)
    Delivery.objects.filter(pk=delivery_id).update(
        created_at=F("created_at") - shift, last_attempt_at=F("last_attempt_at") - shift,
        next_attempt_at=F("next_attempt_at") - shift)
    DeliveryAttempt.objects.filter(delivery_id=delivery_id).update(
        started_at=F("started_at") - shift, finished_at=F("finished_at") - shift,
        next_attempt_at=F("next_attempt_at") - shift)
