"""The per-webhook send slot, against the real Redis, raced by threads and by processes."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time

import redis

from notifications.ratelimit import acquire, acquire_blocking, client_from_url, key_for_url

from .conftest import REDIS_URL


def test_first_caller_sends_the_next_waits_for_the_rest_of_the_interval(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    key = redis_prefix + "hook"
    assert acquire(redis_client, key, 0.5) == 0.0
    wait = acquire(redis_client, key, 0.5)
    assert 0.3 < wait <= 0.5
    assert 0 < redis_client.pttl(key) <= 500  # the slot expires by itself; nothing to clean up
    time.sleep(wait + 0.02)
    assert acquire(redis_client, key, 0.5) == 0.0


def test_webhooks_are_limited_independently(redis_client: redis.Redis, redis_prefix: str) -> None:
    a = key_for_url("https://hooks.slack.com/services/T1/B1/aaa", prefix=redis_prefix)
    b = key_for_url("https://hooks.slack.com/services/T1/B1/bbb", prefix=redis_prefix)
    assert a != b
    # The URL (a secret) is hashed, not stored in Redis: after the prefix the key is a bare
    # SHA-256 digest, so nothing of the URL ("https://", "/services/…") can appear in it.
    for key in (a, b):
        assert key.startswith(redis_prefix)
        assert re.fullmatch(r"[0-9a-f]{64}", key.removeprefix(redis_prefix))
    assert acquire(redis_client, a) == 0.0
    assert acquire(redis_client, b) == 0.0
    assert acquire(redis_client, a) > 0


def test_a_key_without_expiry_cannot_block_a_webhook_forever(redis_client: redis.Redis, redis_prefix: str) -> None:
    key = redis_prefix + "stuck"
    redis_client.set(key, "1")  # no TTL
    assert acquire(redis_client, key, 0.2) == 0.2
    assert 0 < redis_client.pttl(key) <= 200
    time.sleep(0.25)
    assert acquire(redis_client, key, 0.2) == 0.0


def test_threads_racing_at_once_get_exactly_one_slot(redis_prefix: str) -> None:
    key = redis_prefix + "burst"
    workers = 16
    clients = [client_from_url(REDIS_URL) for _ in range(workers)]  # a connection each, like workers
    lock = threading.Lock()
    for rnd in range(4):
        barrier = threading.Barrier(workers)
        waits: list[float] = []

        def race(client: redis.Redis, barrier: threading.Barrier = barrier, waits: list[float] = waits) -> None:
            barrier.wait()
            result = acquire(client, key, 0.3)
            with lock:
                waits.append(result)

        threads = [threading.Thread(target=race, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert len(waits) == workers
        assert waits.count(0.0) == 1, f"round {rnd}: {waits}"
        assert all(0 < w <= 0.3 for w in waits if w)
        time.sleep(max(waits) + 0.02)
    for c in clients:
        c.close()


def test_sustained_contention_never_sends_twice_in_one_interval(redis_prefix: str) -> None:
    key = redis_prefix + "sustained"
    interval = 0.2
    duration = 2.0
    grants: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def worker() -> None:
        client = client_from_url(REDIS_URL)
        try:
            while time.monotonic() < stop_at:
                wait = acquire(client, key, interval)
                if wait == 0:
                    with lock:
                        grants.append(time.monotonic())
                else:
                    time.sleep(min(wait, 0.05))  # poll more often than the slot frees
        finally:
            client.close()

    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    elapsed = time.monotonic() - started

    grants.sort()
    assert len(grants) <= int(elapsed / interval) + 1
    assert len(grants) >= int(duration / interval) - 2  # and the limiter does let messages through
    gaps = [b - a for a, b in zip(grants, grants[1:], strict=False)]
    # Timestamps are taken after acquire returns, so scheduling noise can shave a little off
    # a gap; two sends in the same interval would show up as a gap near zero.
    assert min(gaps) > interval * 0.6, gaps


def _race_in_process(key: str, barrier, results, rounds: int, interval: float) -> None:  # noqa: ANN001
    client = client_from_url(REDIS_URL)
    for rnd in range(rounds):
        barrier.wait()
        results.put((rnd, acquire(client, key, interval)))
        barrier.wait()
        time.sleep(interval + 0.05)
    client.close()


def test_processes_racing_get_exactly_one_slot_per_interval(redis_prefix: str) -> None:
    key = redis_prefix + "procs"
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: nothing shared but Redis
    processes, rounds, interval = 4, 3, 0.5
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_race_in_process, args=(key, barrier, results, rounds, interval)) for _ in range(processes)
    ]
    for p in procs:
        p.start()
    collected = [results.get(timeout=60) for _ in range(processes * rounds)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rnd in range(rounds):
        waits = [w for r, w in collected if r == rnd]
        assert len(waits) == processes
        assert waits.count(0.0) == 1, f"round {rnd}: {waits}"


def test_acquire_blocking_waits_for_the_slot(redis_client: redis.Redis, redis_prefix: str) -> None:
    key = redis_prefix + "blocking"
    assert acquire(redis_client, key, 0.3) == 0.0
    started = time.monotonic()
    assert acquire_blocking(redis_client, key, 0.3, timeout_s=2) is True
    assert 0.2 < time.monotonic() - started < 1.0
    # The slot is held now: with a shorter timeout than the interval, give up.
    assert acquire_blocking(redis_client, key, 0.3, timeout_s=0.05) is False
