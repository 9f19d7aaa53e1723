"""Failed Bearer authentications are limited per client address (PORTAL_THROTTLE_BAD_TOKEN).

DRF authenticates before it throttles: without this limit a request with a wrong token was answered 401
without ever being counted, so one address could send unlimited token lookups.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

RATE = "3/min"


def _address() -> str:
    n = uuid.uuid4().int
    return f"10.{n % 250}.{(n >> 8) % 250}.{(n >> 16) % 250 + 1}"


@pytest.fixture
def addresses():
    made: list[str] = []

    def make() -> str:
        made.append(_address())
        return made[-1]

    yield make
    conn = redis.Redis.from_url(settings.REDIS_URL)
    prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
    for address in made:
        for name in conn.scan_iter(f"{prefix}:throttle:bad_token:*:{address}"):
            conn.delete(name)


def _client(address: str, token: str, **extra) -> APIClient:
    c = APIClient(REMOTE_ADDR=address, **extra)
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return c


def _token_lookups(queries) -> int:
    return sum('"tenants_apitoken"' in q["sql"] for q in queries)


@override_settings(PORTAL_THROTTLE_BAD_TOKEN=RATE)
def test_a_flood_of_bad_tokens_is_refused_before_the_lookup_and_only_from_its_address(world, addresses):
    flooder, other = addresses(), addresses()
    bad = _client(flooder, "gpp_" + "x" * 43)
    assert [bad.get("/api/v1/pools/").status_code for _ in range(3)] == [401, 401, 401]
    with CaptureQueriesContext(connection) as queries:
        r = bad.get("/api/v1/pools/")
    assert r.status_code == 429 and r.json()["code"] == "throttled"
    assert 1 <= int(r["Retry-After"]) <= 20  # one failure frees every 20 s at 3/min
    assert _token_lookups(queries.captured_queries) == 0  # answered before the token lookup
    # Any bad token from that address, and a malformed header too.
    assert _client(flooder, "gpp_another-guess").get("/api/v1/pools/").status_code == 429
    # Another address is not affected.
    assert _client(other, "gpp_" + "x" * 43).get("/api/v1/pools/").status_code == 401


@override_settings(PORTAL_THROTTLE_BAD_TOKEN=RATE)
def test_malformed_headers_count_too(world, addresses):
    flooder = addresses()
    c = APIClient(REMOTE_ADDR=flooder, HTTP_AUTHORIZATION="Bearer a b")
    assert [c.get("/api/v1/pools/").status_code for _ in range(4)] == [401, 401, 401, 429]


@override_settings(PORTAL_THROTTLE_BAD_TOKEN=RATE)
def test_a_token_in_use_from_the_flooded_address_is_still_served(world, addresses):
    from tenants.services import token_issue

    flooder = addresses()
    mine = _client(flooder, world.tokens["alpha-member"])
    assert mine.get("/api/v1/pools/").status_code == 200  # served before the flood
    bad = _client(flooder, "gpp_" + "y" * 43)
    assert [bad.get("/api/v1/pools/").status_code for _ in range(4)] == [401, 401, 401, 429]
    # A working token proves its client is not guessing: looked up and served, no Redis asked on its way.
    assert mine.get("/api/v1/pools/").status_code == 200
    # A token this process has not served yet is refused with the flood (documented in docs/settings.md).
    new_key = token_issue(user=world.users["alpha-member"])[1]
    r = _client(flooder, new_key).get("/api/v1/pools/")
    assert r.status_code == 429 and r.json()["code"] == "throttled"


@override_settings(PORTAL_THROTTLE_BAD_TOKEN=RATE)
def test_a_revoked_token_that_was_served_counts_as_a_failure(world, addresses):
    from tenants.models import ApiToken
    from tenants.services import token_issue

    flooder = addresses()
    token, key = token_issue(user=world.users["alpha-member"])
    c = _client(flooder, key)
    assert c.get("/api/v1/pools/").status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(revoked=True)
    assert [c.get("/api/v1/pools/").status_code for _ in range(4)] == [401, 401, 401, 429]


@override_settings(PORTAL_THROTTLE_BAD_TOKEN=RATE)
def test_refused_requests_write_nothing(world, addresses, t0):
    from reservations.models import Reservation
    from tenants.services import token_issue

    flooder = addresses()
    body = {"tenant": "alpha", "pool": "h100", "node_count": 1,
            "start": t0.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "end": (t0 + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    bad = _client(flooder, "gpp_" + "z" * 43)
    assert [bad.post("/api/v1/reservations/", body, format="json").status_code for _ in range(4)] == [
        401, 401, 401, 429]
    token, key = token_issue(user=world.users["alpha-lead"])
    r = _client(flooder, key).post("/api/v1/reservations/", body, format="json")
    assert r.status_code == 429
    assert not Reservation.objects.exists()
    token.refresh_from_db()
    assert token.last_used_at is None


@override_settings(PORTAL_THROTTLE_BAD_TOKEN=RATE)
def test_behind_a_trusted_proxy_the_forwarded_address_is_counted(world, addresses):
    flooder, other = addresses(), addresses()
    with override_settings(REST_FRAMEWORK={**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}):
        def get(address):
            return _client("127.0.0.1", "gpp_" + "w" * 43, HTTP_X_FORWARDED_FOR=f"6.6.6.6, {address}").get(
                "/api/v1/pools/").status_code

        assert [get(flooder) for _ in range(4)] == [401, 401, 401, 429]
        assert get(other) == 401


@override_settings(PORTAL_THROTTLE_BAD_TOKEN="")
def test_empty_turns_it_off(world, addresses):
    bad = _client(addresses(), "gpp_" + "v" * 43)
    assert {bad.get("/api/v1/pools/").status_code for _ in range(5)} == {401}


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_served_token_asks_redis_nothing_and_redis_down_lets_failures_through(world, addresses, caplog):
    import logging

    from portal.core import throttle

    client = _client(addresses(), world.tokens["beta-viewer"])
    assert client.get("/api/v1/pools/").status_code == 200  # served once by this process
    throttle._client.cache_clear()
    try:
        with override_settings(REDIS_URL=f"redis://127.0.0.1:{_unused_port()}/0", PORTAL_THROTTLE_USER="",
                               PORTAL_THROTTLE_BAD_TOKEN=RATE), \
                caplog.at_level(logging.WARNING, logger="tenants.auth"):
            assert client.get("/api/v1/pools/").status_code == 200
            assert not [r for r in caplog.records if r.name == "tenants.auth"]  # Redis never asked
            bad = _client(addresses(), "gpp_" + "u" * 43)
            assert [bad.get("/api/v1/pools/").status_code for _ in range(4)] == [401] * 4
    finally:
        throttle._client.cache_clear()
    assert sum("Redis unavailable" in r.getMessage() for r in caplog.records if r.name == "tenants.auth") == 8
