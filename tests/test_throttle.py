"""API rate limits: GCRA in Redis, raced by threads and processes, through the API, and with Redis gone."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from portal.core.throttle import Rate, acquire, parse_rate

# No model imports at module level: the process race spawns children that import this module
# for its worker function without setting Django up.

REDIS_URL = settings.REDIS_URL


@pytest.fixture
def client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


@pytest.fixture
def key(client: redis.Redis):
    name = f"test:throttle:{uuid.uuid4().hex}"
    yield name
    client.delete(name)


def test_rates_parse_like_drf() -> None:
    assert parse_rate("1200/min") == Rate(1200, 60)
    assert parse_rate("10/second") == Rate(10, 1)
    assert parse_rate("5/hour") == Rate(5, 3600)
    assert parse_rate("7/day") == Rate(7, 86400)
    for bad in ("", "min", "x/min", "10/fortnight", "0/min", "-1/min", "1/2/min"):
        with pytest.raises(ImproperlyConfigured):
            parse_rate(bad)


def test_a_burst_of_n_then_one_per_interval(client: redis.Redis, key: str) -> None:
    rate = Rate(3, 60)  # burst 3, then one every 20 s
    first = time.monotonic()  # bounds below subtract the time this test itself took (a busy machine)
    assert [acquire(client, key, rate) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = acquire(client, key, rate)
    assert 20.0 - (time.monotonic() - first) - 0.01 <= wait <= 20.0
    again = acquire(client, key, rate)
    assert wait - (time.monotonic() - first) - 0.01 <= again <= wait  # a refusal is not counted
    # The state expires by itself once the bucket would be empty again: nothing to clean up.
    assert 60_000 - (time.monotonic() - first) * 1000 - 10 <= client.pttl(key) <= 60_000


def test_the_client_that_waits_gets_its_request_in(client: redis.Redis, key: str) -> None:
    rate = Rate(2, 4)  # burst 2, then one every 2 s
    first = time.monotonic()
    assert acquire(client, key, rate) == 0.0
    assert acquire(client, key, rate) == 0.0
    wait = acquire(client, key, rate)
    assert 2.0 - (time.monotonic() - first) - 0.01 <= wait <= 2.0
    time.sleep(wait + 0.02)
    assert acquire(client, key, rate) == 0.0  # the one that waited gets in...
    assert acquire(client, key, rate) > 0  # ...and the burst has not come back (it refills at one per 2 s)


def test_garbage_in_the_key_is_treated_as_an_empty_bucket(client: redis.Redis, key: str) -> None:
    client.set(key, "not-a-number")
    first = time.monotonic()
    assert acquire(client, key, Rate(1, 60)) == 0.0
    assert acquire(client, key, Rate(1, 60)) >= 60 - (time.monotonic() - first) - 0.01


def _race(url: str, key: str, attempts: int, barrier, results) -> None:
    own = redis.Redis.from_url(url)  # a connection each, like separate web processes
    barrier.wait()
    allowed = sum(1 for _ in range(attempts) if acquire(own, key, Rate(20, 3600)) == 0.0)
    if isinstance(results, list):
        results.append(allowed)
    else:
        results.put(allowed)


def test_threads_racing_never_get_more_than_the_burst(key: str) -> None:
    workers, attempts = 16, 5  # 80 attempts at once against a burst of 20 (then one per 3 min)
    barrier = threading.Barrier(workers)
    results: list[int] = []
    threads = [threading.Thread(target=_race, args=(REDIS_URL, key, attempts, barrier, results))
               for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == workers and sum(results) == 20


def test_processes_racing_never_get_more_than_the_burst(key: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    workers, attempts = 6, 8
    barrier = ctx.Barrier(workers)
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(REDIS_URL, key, attempts, barrier, results)) for _ in range(workers)]
    for p in procs:
        p.start()
    allowed = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(allowed) == 20


def test_the_api_limits_each_user_on_its_own(world) -> None:
    from .conftest import forget_throttle_budgets

    forget_throttle_budgets(world.users["alpha-lead"], world.users["beta-lead"])
    with override_settings(PORTAL_THROTTLE_USER="2/min"):
        a, b = world.client("alpha-lead"), world.client("beta-lead")
        assert [a.get("/api/v1/pools/").status_code for _ in range(3)] == [200, 200, 429]
        r = a.get("/api/v1/reservations/")
        assert r.status_code == 429 and r.json()["code"] == "throttled"
        assert 1 <= int(r["Retry-After"]) <= 30  # one request frees every 30 s at 2/min
        assert [b.get("/api/v1/pools/").status_code for _ in range(2)] == [200, 200]


def test_a_throttled_booking_stores_nothing(world, t0) -> None:
    from reservations.models import Reservation

    from .conftest import forget_throttle_budgets

    forget_throttle_budgets(world.users["alpha-lead"])
    body = {"tenant": "alpha", "pool": "h100", "node_count": 1,
            "start": t0.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "end": (t0 + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    with override_settings(PORTAL_THROTTLE_USER="1/min"):
        c = world.client("alpha-lead")
        assert c.get("/api/v1/pools/").status_code == 200
        r = c.post("/api/v1/reservations/", body, format="json")
        assert r.status_code == 429 and r.json()["code"] == "throttled"
    assert not Reservation.objects.exists()


def _unused_port() -> int:
    """A loopback port nothing listens on: bound by us, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_lets_requests_through_and_says_so(world, caplog) -> None:
    from portal.core import throttle

    throttle._client.cache_clear()
    try:
        with override_settings(REDIS_URL=f"redis://127.0.0.1:{_unused_port()}/0", PORTAL_THROTTLE_USER="1/min"), \
                caplog.at_level(logging.WARNING, logger="portal.core.throttle"):
            c = world.client("alpha-viewer")
            assert [c.get("/api/v1/pools/").status_code for _ in range(3)] == [200, 200, 200]
    finally:
        throttle._client.cache_clear()
    # One warning per request from the user throttle (the token's first use here also logs one of its own,
    # from the failed-authentication check in tenants.auth).
    assert sum("Redis unavailable" in rec.getMessage() for rec in caplog.records
               if rec.name == "portal.core.throttle") == 3


@pytest.mark.parametrize("garbage", ["inf", "1e300", "nan", "-inf", "99999999999999999999"])
def test_number_shaped_garbage_is_an_empty_bucket_too(client: redis.Redis, key: str, garbage: str) -> None:
    client.set(key, garbage)  # not written by the script (by hand, an older scheme, a clock gone back)
    first = time.monotonic()
    assert acquire(client, key, Rate(1, 60)) == 0.0
    assert 60 - (time.monotonic() - first) - 0.01 <= acquire(client, key, Rate(1, 60)) <= 60
    assert 0 < client.pttl(key) <= 60_000  # and it expires again


def _anon_budget_key(address: str) -> str:
    prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
    return f"{prefix}:throttle:anon:{parse_rate('1/min')}:{address}"


@pytest.mark.django_db
def test_anonymous_clients_are_limited_by_address_not_by_what_they_claim(client: redis.Redis) -> None:
    from django.test import Client

    addresses = [f"10.{n}.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}" for n in (1, 2, 3)]
    client.delete(*[_anon_budget_key(a) for a in addresses])
    try:
        with override_settings(PORTAL_THROTTLE_ANON="1/min"):
            # No trusted proxy: a client inventing X-Forwarded-For gets no fresh budget.
            spoofer = Client(REMOTE_ADDR=addresses[0])
            assert spoofer.get("/api/schema/", HTTP_X_FORWARDED_FOR="1.2.3.4").status_code == 200
            r = spoofer.get("/api/schema/", HTTP_X_FORWARDED_FOR="5.6.7.8")
            assert r.status_code == 429 and int(r["Retry-After"]) >= 1
            # Behind one trusted proxy: the address the proxy appended is the client.
            rest = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
            with override_settings(REST_FRAMEWORK=rest):
                proxy = Client(REMOTE_ADDR="127.0.0.1")
                assert proxy.get("/api/schema/", HTTP_X_FORWARDED_FOR=f"6.6.6.6, {addresses[1]}").status_code == 200
                assert proxy.get("/api/schema/", HTTP_X_FORWARDED_FOR=f"7.7.7.7, {addresses[1]}").status_code == 429
                assert proxy.get("/api/schema/", HTTP_X_FORWARDED_FOR=addresses[2]).status_code == 200
    finally:
        client.delete(*[_anon_budget_key(a) for a in addresses])
