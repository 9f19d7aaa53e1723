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
    before = time.monotonic()
    assert acquire(redis_client, key, 0.5) == 0.0
    wait = acquire(redis_client, key, 0.5)
    gap = time.monotonic() - before  # at least the time between the two calls on the server
    # The rest of the interval: all of it but what passed between the two calls (whole ms).
    assert 0 < wait <= 0.5
    assert wait >= 0.5 - gap - 0.002, (wait, gap)
    ttl = redis_client.pttl(key)
    if time.monotonic() - before < 0.5:
        assert 0 < ttl <= 500  # the slot expires by itself; nothing to clean up
    else:  # this machine stalled past the interval: the slot must already be gone by itself
        assert ttl == -2, ttl
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
    # Every call as (sent before, answered after, wait): the server handled it in between.
    grants: list[tuple[float, float]] = []
    denials: list[tuple[float, float, float]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def worker() -> None:
        client = client_from_url(REDIS_URL)
        try:
            while time.monotonic() < stop_at:
                before = time.monotonic()
                wait = acquire(client, key, interval)
                after = time.monotonic()
                with lock:
                    if wait == 0:
                        grants.append((before, after))
                    else:
                        denials.append((before, after, wait))
                if wait:
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

    tol = 0.01  # Redis counts in whole milliseconds on its own clock
    grants.sort()
    assert grants, "the first call on a fresh key must be granted"
    assert len(grants) <= int(elapsed / interval) + 1
    # Never twice in one interval: of any two grants one came at least an interval after the
    # other on the server, and each happened between its own before and after.
    for i, (before_a, after_a) in enumerate(grants):
        for before_b, after_b in grants[i + 1:]:
            assert max(after_b - before_a, after_a - before_b) > interval * 0.95, (grants, i)
    # And the limiter does let messages through: a caller is only turned away by a grant made
    # within the interval before, whose slot frees when its answer says (grant + interval).
    for before, after, wait in denials:
        assert 0 < wait <= interval
        lo, hi = before + wait - interval - tol, after + wait - interval + tol
        assert any(g_before <= hi and g_after >= lo for g_before, g_after in grants), (before, after, wait)
    # So every call that came more than an interval after the previous counted one's answer
    # needed a grant of its own: that many grants at least, however this machine scheduled us.
    calls = sorted([(b, a) for b, a in grants] + [(b, a) for b, a, _ in denials])
    needed, last_after = 0, float("-inf")
    for before, after in calls:
        if before > last_after + interval + tol:
            needed, last_after = needed + 1, after
    assert len(grants) >= needed, (len(grants), needed)


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
    before = time.monotonic()  # before the first grant: the next one comes a whole interval after it
    assert acquire(redis_client, key, 0.3) == 0.0
    started = time.monotonic()
    assert acquire_blocking(redis_client, key, 0.3, timeout_s=2) is True
    done = time.monotonic()
    assert done - before > 0.3 - 0.002, done - before
    assert done - started < 1.0
    # The slot is held now: with a shorter timeout than the interval, give up.
    assert acquire_blocking(redis_client, key, 0.3, timeout_s=0.05) is False
