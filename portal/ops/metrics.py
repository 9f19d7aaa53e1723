"""Prometheus metrics of the portal: process-local counters and the /metrics exposition.

Two kinds of metric families:

* **Measured in this process** (counters and histograms below): booking outcomes and
  latency (``observe_booking``, fed by the booking view through ``booking_finished``) and HTTP requests
  (``RequestMetricsMiddleware``). Under gunicorn with several workers set
  ``PROMETHEUS_MULTIPROC_DIR`` (gunicorn.conf.py does) and every worker's values are summed at
  scrape time.
* **Counted in Redis by every process**: domain events (a ``"*"`` subscriber, ``count_event``).
  Most of them are emitted in Celery workers (cluster phases, node failures found by health
  checks, reminders), which Prometheus never scrapes; the counts live in one Redis hash
  (REDIS_URL) that the scrape reads.
* **Read from the database and the broker at scrape time** (``portal.ops.collectors``): fleet,
  GPUs, utilisation, reservations, provisioning, health, notifications, Celery queue depths.
  They are the same whichever process answers the scrape, so nothing is lost when a worker
  restarts, and work done in Celery workers is visible without scraping the workers.

The booking view is timed by ``portal.core.instrument.timed_booking`` (a lower layer, so the
view never imports this module): it sends ``booking_finished``, which ``on_booking_finished``
receives and records with ``observe_booking("created", 0.042)`` (outcome, seconds) — the outcome
is the envelope code the client got (``capacity_unavailable``, ``quota_exceeded``, ``invalid``, …),
``created``/``replayed`` for a 2xx.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from django.conf import settings
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
)
from prometheus_client.exposition import choose_encoder

from . import multiproc

__all__ = [
    "BOOKING_OUTCOMES",
    "REGISTRY",
    "observe_booking",
    "count_event",
    "install",
    "render",
    "RequestMetricsMiddleware",
]

logger = logging.getLogger(__name__)

# Outcomes of POST /api/v1/reservations/: "created", "replayed" (an Idempotency-Key's earlier booking
# answered again: nothing new was booked) and the envelope codes a booking can end with (every 4xx
# one portal.core.api can send for it); "error" is anything else: a server error.
BOOKING_OUTCOMES = (
    "created",
    "replayed",
    "capacity_unavailable",
    "quota_exceeded",
    "invalid",
    "permission_denied",
    "not_authenticated",
    "not_found",
    "invalid_state",
    "throttled",
    "not_acceptable",
    "error",
)
# Booking latency: the SQL path is milliseconds; contention retries and suggestions take longer.
BOOKING_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

# The process-local metrics live in a registry of their own: the /metrics view builds a fresh
# registry per scrape around it (plus the database collectors), and tests can read it directly.
REGISTRY = CollectorRegistry(auto_describe=True)

BOOKING_REQUESTS = Counter(
    "portal_booking_requests",
    "Booking requests (POST /api/v1/reservations/) by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
BOOKING_DURATION = Histogram(
    "portal_booking_duration_seconds",
    "Time to answer a booking request, by outcome.",
    ["outcome"],
    buckets=BOOKING_BUCKETS,
    registry=REGISTRY,
)
HTTP_REQUESTS = Counter(
    "portal_http_requests",
    "HTTP requests answered, by method, URL name and status code.",
    ["method", "view", "status"],
    registry=REGISTRY,
)
HTTP_DURATION = Histogram(
    "portal_http_request_duration_seconds",
    "Time to answer an HTTP request, by method and URL name.",
    ["method", "view"],
    buckets=HTTP_BUCKETS,
    registry=REGISTRY,
)

# Every outcome appears from the first scrape on (at 0), so rate() and dashboards need no absent().
for _outcome in BOOKING_OUTCOMES:
    BOOKING_REQUESTS.labels(_outcome)
    BOOKING_DURATION.labels(_outcome)


def _multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


if not _multiprocess_dir():
    # Process, platform and GC metrics only make sense for a single process.
    for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        REGISTRY.register(_collector)


def observe_booking(outcome: str, seconds: float) -> None:
    """Count one booking request and its latency.

    outcome: ``"created"`` or the error envelope's ``code`` (one of BOOKING_OUTCOMES; anything
    else is counted as ``"error"``). seconds: wall time from request to answer.
    """
    if outcome not in BOOKING_OUTCOMES:
        outcome = "error"
    BOOKING_REQUESTS.labels(outcome).inc()
    BOOKING_DURATION.labels(outcome).observe(max(0.0, float(seconds)))


def on_booking_finished(sender, *, outcome: str, seconds: float, **kwargs: Any) -> None:
    """Receive portal.core.instrument.booking_finished (sent by the booking API view)."""
    observe_booking(outcome, seconds)


def domain_events_key() -> str:
    """The Redis hash (on REDIS_URL) holding the count of each domain event: field = event name."""
    prefix = settings.CACHES.get("default", {}).get("KEY_PREFIX", "")
    return f"{prefix}:metrics:domain_events" if prefix else "metrics:domain_events"


def count_event(event: str, payload: dict[str, Any]) -> None:
    """Domain-event subscriber: count every event by name, in Redis, whichever process emitted it."""
    import redis

    from portal.core.throttle import redis_client

    try:
        # The process's pooled client with short timeouts (the throttles' and the outbox wake-up's): a stalled
        # Redis costs the emitting request or task milliseconds, never more.
        redis_client().hincrby(domain_events_key(), event, 1)
    except (redis.RedisError, OSError) as exc:
        logger.warning("metrics: could not count event %s: %s", event, exc.__class__.__name__)


def install() -> None:
    """Subscribe the metrics to the domain events (idempotent; called from OpsConfig.ready)."""
    from portal.core import events

    events.subscribe("*", count_event)


class _ProcessMetrics:
    """Yield this process's metrics, or every gunicorn worker's summed in multiprocess mode."""

    def collect(self):
        directory = _multiprocess_dir()
        if directory:
            # Live workers' files plus the archive of dead ones (gunicorn.conf.py's child_exit).
            yield from multiproc.collect(directory)
        else:
            yield from REGISTRY.collect()


def build_registry() -> CollectorRegistry:
    """Return a registry holding everything /metrics exposes, built for one scrape."""
    from .collectors import PortalCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProcessMetrics())
    registry.register(PortalCollector())
    return registry


def render(accept_header: str = "") -> tuple[bytes, str]:
    """Return the exposition body and its content type (OpenMetrics when the scraper asks for it)."""
    encoder, content_type = choose_encoder(accept_header)
    return encoder(build_registry()), content_type


class RequestMetricsMiddleware:
    """Count requests and time them, labelled by URL name (never by raw path: bounded cardinality)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        view = (match.view_name if match is not None else "") or "unmatched"
        if view == "ops-metrics":
            return response  # scrapes would dominate the request rate
        elapsed = time.perf_counter() - started
        method = request.method if request.method in HTTP_METHODS else "other"
        HTTP_REQUESTS.labels(method, view, str(response.status_code)).inc()
        HTTP_DURATION.labels(method, view).observe(elapsed)
        return response
