"""Web security regression checks: no redirect taking user input leaves the site, every state-changing
address refuses a POST without the CSRF token (pages, htmx fragments and the session-authenticated API),
and a signed-in non-staff user never reaches the admin."""

from __future__ import annotations

import re

import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import get_resolver

from reservations.models import Reservation
from tenants import forms as tenant_forms
from tenants.models import ApiToken

pytestmark = pytest.mark.django_db

PASSWORD = "pw-Long-enough-1"
ELSEWHERE = ["//evil.example", "/\\evil.example", "\\\\evil.example", "https:evil.example", "https://evil.example",
             "http:/evil.example", "///evil.example", "https:///evil.example", " //evil.example", "\t//evil.example",
             "/\t/evil.example", "//evil.example@testserver", "javascript:alert(1)", "data:text/html,hi"]


@pytest.fixture(autouse=True)
def clean_lockout_keys():
    def clear():
        for kind in ("fail-user", "lock-user"):
            cache.delete(tenant_forms._key(kind, "alpha-lead"))
        for kind in ("fail-ip", "lock-ip"):
            cache.delete(tenant_forms._key(kind, "127.0.0.1"))

    clear()
    yield
    clear()


def _leaves(location: str | None) -> bool:
    return bool(location) and ("evil" in location or location.startswith(("javascript:", "data:")))


@pytest.mark.parametrize("target", ELSEWHERE)
def test_no_redirect_taking_user_input_leaves_the_site(world, target):
    client = Client()
    signed_in = client.post(f"/accounts/login/?next={target}", {"username": "alpha-lead", "password": PASSWORD})
    assert signed_in.status_code == 302 and signed_in["Location"] == "/", signed_in.get("Location")
    assert not _leaves(client.get(f"/accounts/login/?next={target}").get("Location"))  # already signed in
    for url, data, headers in [("/tenant/switch/", {"tenant": "alpha", "next": target}, {}),
                               ("/tenant/switch/", {"tenant": "alpha"}, {"HTTP_REFERER": target}),
                               ("/tenant/calendar-feed/rotate/", {"next": target}, {}),
                               ("/tenant/calendar-feed/rotate/", {}, {"HTTP_REFERER": target})]:
        response = client.post(url, data, **headers)
        assert response.status_code == 302 and not _leaves(response["Location"]), (url, response["Location"])
    assert not _leaves(client.get("/clusters/1/teardown/", HTTP_REFERER=target).get("Location"))
    out = client.post("/accounts/logout/", {"next": target})
    assert out.status_code == 302 and not _leaves(out["Location"]), out["Location"]
    admin = Client().post(f"/admin/login/?next={target}", {"username": "staff", "password": PASSWORD})
    assert admin.status_code == 302 and not _leaves(admin["Location"]), admin["Location"]


def _addresses():
    def walk(resolver, prefix=""):
        for pattern in resolver.url_patterns:
            if hasattr(pattern, "url_patterns"):
                yield from walk(pattern, prefix + str(pattern.pattern))
            else:
                yield prefix + str(pattern.pattern), pattern.callback

    for route, view in walk(get_resolver()):
        route = route.replace("^", "").replace("$", "")
        if route.startswith("admin/") or "(?P" in route or route in ("healthz", "readyz", "metrics"):
            continue  # the admin is Django's; DRF's router patterns are regexes (their lists are covered)
        yield "/" + re.sub(r"<int:\w+>", "1", re.sub(r"<(slug|str):\w+>", "x", route)), view


def test_no_portal_view_is_csrf_exempt():
    exempt = [url for url, view in _addresses() if getattr(view, "csrf_exempt", False)
              and not url.startswith("/api/v1/") and url not in ("/api/schema/", "/api/docs/", "/api/redoc/")]
    assert not exempt, exempt


@pytest.mark.parametrize("who", ["staff", "alpha-lead"])
def test_a_post_without_the_csrf_token_is_refused_everywhere(world, who):
    client = Client(enforce_csrf_checks=True)
    token = client.get("/accounts/login/").cookies["csrftoken"].value
    client.post("/accounts/login/", {"username": who, "password": PASSWORD, "csrfmiddlewaretoken": token})
    reservations, tokens = Reservation.objects.count(), ApiToken.objects.count()
    refused = {}
    for url, _view in _addresses():
        if url in ("/api/schema/", "/api/docs/", "/api/redoc/"):
            continue  # read-only documentation
        if url.startswith("/api/v1/"):
            response = client.post(url, {"name": "x"}, content_type="application/json")
        else:
            response = client.post(url, {"name": "x", "tenant": "alpha"}, HTTP_HX_REQUEST="true")
        refused[url] = response.status_code
    assert {url: status for url, status in refused.items() if status not in (403, 405)} == {}
    assert Reservation.objects.count() == reservations and ApiToken.objects.count() == tokens


def test_the_admin_is_for_staff_only(world):
    client = Client()
    client.force_login(world.users["alpha-lead"])
    for url in ("/admin/", "/admin/auth/user/", "/admin/tenants/tenant/", "/admin/reservations/reservation/"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), url
