"""/healthz, /readyz and /metrics: plain Django views, outside DRF (no auth classes, no throttles)."""

from __future__ import annotations

import hmac
import ipaddress
import logging

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_safe

from . import health, metrics

__all__ = ["healthz", "readyz", "metrics_view", "metrics_access_allowed"]

logger = logging.getLogger(__name__)
DEFAULT_ALLOWED_NETWORKS = ("127.0.0.0/8", "::1/128")


@never_cache
@require_safe  # GET or HEAD: uptime monitors and load balancers often probe with HEAD
def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness: the process answers. Touches nothing else, so a database outage never restarts web."""
    return JsonResponse({"status": "ok"})


@never_cache
@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: PostgreSQL (migrated), Redis and a Celery worker answer; 503 with the failing checks otherwise."""
    results = health.readiness()
    ready = all(r.ok for r in results.values())
    body = {"status": "ok" if ready else "unavailable", "checks": {k: v.as_dict() for k, v in results.items()}}
    return JsonResponse(body, status=200 if ready else 503)


def _client_ips(request: HttpRequest) -> list:
    """REMOTE_ADDR as an address, plus the IPv4 address it maps where it is one (::ffff:a.b.c.d).

    gunicorn bound to [::] reports an IPv4 peer as an IPv4-mapped IPv6 address, which is in no IPv4
    network: the IPv4 networks listed for the scraper would never match it.
    """
    try:
        ip = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return []
    mapped = getattr(ip, "ipv4_mapped", None)
    return [ip] if mapped is None else [ip, mapped]


def metrics_access_allowed(request: HttpRequest) -> tuple[bool, int]:
    """Return (allowed, status to answer otherwise).

    Allowed with ``Authorization: Bearer <PORTAL_METRICS_TOKEN>`` (when a token is set), or from
    an address inside PORTAL_METRICS_ALLOWED_NETWORKS (REMOTE_ADDR: the peer that connected, never
    a forwarded header a client could forge).
    """
    token = getattr(settings, "PORTAL_METRICS_TOKEN", "") or ""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if token and header.startswith("Bearer "):
        if hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode()):
            return True, 200
        return False, 401
    ips = _client_ips(request)
    networks = getattr(settings, "PORTAL_METRICS_ALLOWED_NETWORKS", DEFAULT_ALLOWED_NETWORKS)
    if ips:
        for network in networks:
            if not network:
                continue
            try:
                if any(ip in ipaddress.ip_network(network, strict=False) for ip in ips):
                    return True, 200
            except ValueError:
                logger.error("PORTAL_METRICS_ALLOWED_NETWORKS: %r is not a network", network)
    return False, 401 if token else 403


@never_cache
@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    allowed, status = metrics_access_allowed(request)
    if not allowed:
        response = HttpResponse("Forbidden\n" if status == 403 else "Unauthorized\n", status=status,
                                content_type="text/plain")
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    body, content_type = metrics.render(request.META.get("HTTP_ACCEPT", ""))
    return HttpResponse(body, content_type=content_type)
