"""API rate limits that hold across every web process: GCRA in one Redis script.

DRF's stock ``SimpleRateThrottle`` keeps each client's request history as a list in the
cache and does get → trim → set from Python. Two processes answering the same client at
once both read the old list and both write theirs, so concurrent requests slip through
(a script running 16 threads gets up to 16× its rate); and every request unpickles and
re-pickles a list as long as the rate (1,200 timestamps at the default), through a new
Redis client per cache call.

Here the limit is the generic cell rate algorithm (the "leaky bucket as a meter"): one
number per client — the theoretical arrival time (TAT) of its next request — checked and
advanced by one Lua script, so it is atomic on the Redis server whatever the number of web
processes, O(1) in time and memory, and timed by the Redis server's clock (web hosts with
skewed clocks still agree). ``N/period`` allows a burst of N and then one request every
period/N: a client that waits never has to wait out a whole window. (So a client that spends
its burst and then keeps to the pace gets up to 2N−1 requests into one period's span, where
DRF's sliding window stops at N; the sustained rate is N per period either way.)

If Redis cannot be reached the request is let through and a warning logged: the limiter
protects the API, it must not take it down (``/readyz`` reports Redis separately).
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from rest_framework.throttling import BaseThrottle

__all__ = ["Rate", "parse_rate", "acquire", "peek", "RedisRateThrottle"]

logger = logging.getLogger(__name__)

_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# KEYS[1]: the client's key. ARGV[1]: emission interval (period / N), ARGV[2]: the period, both
# in microseconds. The bucket's read, shared by the two scripts below.
_BUCKET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or 0) or 0
-- A TAT is never beyond now + period. One that is (or NaN: tat ~= tat) was not written by
-- this script, or the server clock stepped back: the client is on a fresh bucket.
local fresh = tat ~= tat or tat < now or tat > now + period
"""
# Returns 0 when the request is allowed (and counted), else the microseconds until it would be.
# Integers are formatted with %.0f: Lua's tostring would write 1.7e+15.
_GCRA_LUA = _BUCKET_LUA + """
if fresh then
    tat = now
end
local new_tat = tat + interval
local allow_at = new_tat - period
if allow_at > now then
    return allow_at - now
end
local ttl_ms = math.ceil((new_tat - now) / 1000)
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.max(ttl_ms, 1))
return 0
"""

# The same bucket read, not counted: 0 when the next acquire would be allowed, else the microseconds until it is.
_PEEK_LUA = _BUCKET_LUA + """
if fresh then
    return 0
end
local allow_at = tat + interval - period
if allow_at > now then
    return allow_at - now
end
return 0
"""


@dataclass(frozen=True)
class Rate:
    count: int
    period_s: int

    @property
    def interval_us(self) -> int:
        return max(1, self.period_s * 1_000_000 // self.count)

    @property
    def period_us(self) -> int:
        return self.period_s * 1_000_000

    def __str__(self) -> str:
        return f"{self.count}/{self.period_s}s"


@functools.lru_cache(maxsize=32)
def parse_rate(rate: str) -> Rate:
    """Parse "N/period" as DRF does: the period's first letter counts (s, m, h, d): "1200/min", "10/second"."""
    try:
        number, period = rate.split("/")
        count = int(number)
        seconds = _PERIODS[period.strip()[:1].lower()]
    except (ValueError, KeyError, AttributeError):
        raise ImproperlyConfigured(f"Invalid throttle rate {rate!r}; use e.g. '1200/min'.") from None
    if count < 1:
        raise ImproperlyConfigured(f"Invalid throttle rate {rate!r}: at least 1 request per period.")
    return Rate(count=count, period_s=seconds)


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    # One pooled client per process (redis-py resets the pool in a forked child). Short
    # timeouts: a stalled Redis must cost a request milliseconds, not the worker timeout.
    return redis.Redis.from_url(url, socket_connect_timeout=0.25, socket_timeout=0.25)


@functools.lru_cache(maxsize=4)
def _script(client: redis.Redis):
    return client.register_script(_GCRA_LUA)


@functools.lru_cache(maxsize=4)
def _peek_script(client: redis.Redis):
    return client.register_script(_PEEK_LUA)


def acquire(client: redis.Redis, key: str, rate: Rate) -> float:
    """Count one request against key at rate; return 0.0 if allowed, else the seconds to wait.

    A refused request is not counted. Atomic on the Redis server: of any number of
    concurrent callers at most ``rate.count`` are allowed in a burst, then one per interval.
    """
    wait_us = int(_script(client)(keys=[key], args=[rate.interval_us, rate.period_us]))
    return min(max(wait_us, 0), rate.period_us) / 1_000_000


def peek(client: redis.Redis, key: str, rate: Rate) -> float:
    """The seconds until an ``acquire`` of key at rate would be allowed (0.0: now); counts nothing."""
    wait_us = int(_peek_script(client)(keys=[key], args=[rate.interval_us, rate.period_us]))
    return min(max(wait_us, 0), rate.period_us) / 1_000_000


def redis_client():
    """The process's pooled client for settings.REDIS_URL, as the throttles use it."""
    return _client(settings.REDIS_URL)


def redis_key(*parts: object) -> str:
    """A key on REDIS_URL under the deployment's cache KEY_PREFIX (two deployments sharing a Redis stay apart)."""
    return ":".join(str(part) for part in (settings.CACHES["default"].get("KEY_PREFIX", ""), *parts))


def budget_key(scope: str, rate: Rate, ident: str) -> str:
    # The rate is part of the key: changing it starts every client on a fresh budget
    # instead of reading a TAT that was advanced at another pace.
    return redis_key("throttle", scope, rate, ident)


class RedisRateThrottle(BaseThrottle, ABC):
    """A DRF throttle over ``acquire``; subclasses name the rate setting and who is counted."""

    scope = ""
    setting_name = ""

    @abstractmethod
    def ident(self, request) -> str | None:
        """The client this request counts against, or None when this throttle does not apply."""

    def allow_request(self, request, view) -> bool:
        self._wait = 0.0
        rate_setting = getattr(settings, self.setting_name, None)
        ident = self.ident(request)
        if not rate_setting or ident is None:
            return True
        rate = parse_rate(rate_setting)
        key = budget_key(self.scope, rate, ident)
        try:
            self._wait = acquire(redis_client(), key, rate)
        except (redis.RedisError, OSError) as exc:
            logger.warning("throttle %s not applied: Redis unavailable (%s)", self.scope, exc)
            return True
        return self._wait == 0

    def wait(self) -> float | None:
        return self._wait or None
