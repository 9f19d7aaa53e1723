"""At most one message per interval per webhook, across every worker process, via Redis.

Slack allows about one message per second per incoming webhook and answers 429 beyond
that. Celery's ``rate_limit`` counts per worker process, so with several workers it would
still burst; the limit has to live in shared state, and Redis is already there.

Usage in a delivery task::

    wait = acquire(redis_client, key_for_url(webhook_url))
    if wait:
        raise self.retry(countdown=wait)   # someone else sent within the last second
    outcome = transport.post(...)

The check-and-claim is one Lua script, so it is atomic on the Redis server: of any number
of concurrent callers exactly one gets 0 per interval. Time comes from the Redis key's own
expiry (server clock), so workers with skewed clocks still agree.
"""

from __future__ import annotations

import hashlib
import math
import time

import redis

__all__ = ["KEY_PREFIX", "acquire", "acquire_blocking", "hold", "key_for_url", "client_from_url"]

KEY_PREFIX = "portal:notify:rl:"

# KEYS[1]: the webhook's key. ARGV[1]: the interval in milliseconds.
# Returns 0 when this caller now holds the slot, else the milliseconds until it frees.
_ACQUIRE_LUA = """
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then
    return 0
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
    -- A key without expiry (written by hand, or a crash between commands in some older
    -- scheme) would block this webhook forever; give it the interval and make the caller wait.
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    return tonumber(ARGV[1])
end
if ttl == 0 then
    -- Sub-millisecond remainder: never answer 0 unless this caller actually claimed the slot.
    return 1
end
return ttl
"""

# KEYS[1]: the webhook's key. ARGV[1]: milliseconds. Keep the slot taken at least that long from now
# (never shortens a longer hold already there).
_HOLD_LUA = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl < tonumber(ARGV[1]) then
    redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
end
return 0
"""


def key_for_url(url: str, prefix: str = KEY_PREFIX) -> str:
    """Return the rate-limit key for a webhook URL (hashed: the URL itself is a secret)."""
    return prefix + hashlib.sha256(url.encode("utf-8")).hexdigest()


def client_from_url(redis_url: str) -> redis.Redis:
    """Return a Redis client for redis_url (e.g. settings.REDIS_URL)."""
    return redis.Redis.from_url(redis_url)


def acquire(redis_client: redis.Redis, key: str, interval_s: float = 1.0) -> float:
    """Try to claim the send slot for key; return 0.0 if the caller may send now.

    Otherwise claim nothing and return the seconds until the slot frees (> 0); the caller
    waits (or reschedules) that long and calls again. Exactly one concurrent caller per
    interval gets 0, whichever process it runs in.
    """
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    interval_ms = max(1, math.ceil(interval_s * 1000))
    script = redis_client.register_script(_ACQUIRE_LUA)
    wait_ms = int(script(keys=[key], args=[interval_ms]))
    return wait_ms / 1000.0


def hold(redis_client: redis.Redis, key: str, seconds: float) -> None:
    """Keep key's slot taken for at least seconds from now: the webhook said to wait (429 with Retry-After),
    and that holds for every message to it, not only the one that was refused."""
    if seconds <= 0:
        return
    script = redis_client.register_script(_HOLD_LUA)
    script(keys=[key], args=[max(1, math.ceil(seconds * 1000))])


def acquire_blocking(redis_client: redis.Redis, key: str, interval_s: float = 1.0, *, timeout_s: float = 30.0) -> bool:
    """Wait until the slot for key is claimed; return False if that takes over timeout_s.

    For callers that may block (a management command, a test); a Celery task should
    rather use ``acquire`` and retry with a countdown so it does not hold a worker.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        wait = acquire(redis_client, key, interval_s)
        if wait == 0:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(wait, remaining))
