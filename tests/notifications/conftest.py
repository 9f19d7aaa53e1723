"""Fixtures for notification tests: a real loopback webhook receiver and a real Redis.

``webhook_receiver`` is meant for reuse: end-to-end delivery tests (a Celery worker
posting to Slack or a tenant webhook) can point the webhook URL at
``webhook_receiver.url("/services/T000/B000/secret")`` and assert on what arrived.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from .receiver import WebhookReceiver


def _test_redis_url() -> str:
    """The Redis the settings use (REDIS_URL, else 127.0.0.1:6379), but database 15.

    Other test runs sharing this Redis issue FLUSHDB on database 0 (Django's
    RedisCache.clear() is one; the dev server had counted over a thousand), and a flush in
    the middle of a rate-limit race frees the slot and makes the race look lost. FLUSHDB
    only touches its own database, so ours lives in another one.
    """
    url = os.environ.get("NOTIFICATIONS_TEST_REDIS_URL")
    if url:
        return url
    parts = urlsplit(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    if parts.scheme in ("redis", "rediss"):
        return urlunsplit((parts.scheme, parts.netloc, "/15", parts.query, parts.fragment))
    return parts.geturl()


REDIS_URL = _test_redis_url()


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    """A started WebhookReceiver answering 200 ok unless scripted; stopped afterwards."""
    receiver = WebhookReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """A client of the real Redis; a test fails (not skips) when Redis is down."""
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix unique to this test; every key under it is deleted afterwards."""
    prefix = f"test:notify:{uuid.uuid4().hex}:"
    try:
        yield prefix
    finally:
        keys = list(redis_client.scan_iter(match=prefix + "*"))
        if keys:
            redis_client.delete(*keys)
