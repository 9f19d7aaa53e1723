"""Sign-in (session, CSRF, lockout), the tenant switcher, time-zone choice, role-aware navigation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.test import Client

from tenants import forms as tenant_forms

pytestmark = pytest.mark.django_db

PASSWORD = "pw-Long-enough-1"


def forget_sign_in_failures() -> None:
    """Forget sign-in failures and locks of the users and address these tests use (never flush the shared Redis)."""
    for name in ("alpha-lead", "alpha-member", "beta-lead", "nobody"):
        for kind in ("fail-user", "lock-user"):
            cache.delete(tenant_forms._key(kind, name))
    for kind in ("fail-ip", "lock-ip"):
        cache.delete(tenant_forms._key(kind, "127.0.0.1"))


@pytest.fixture(autouse=True)
def clean_lockout_keys():
    forget_sign_in_failures()
    yield
    forget_sign_in_failures()


def _post_login(client: Client, username: str, password: str, **extra):
    return client.post("/accounts/login/", {"username": username, "password": password, **extra})


def test_pages_need_a_session(client, world):
    for url in ("/", "/calendar/", "/availability/", "/account/", "/fleet/", "/reservations/new/"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/"), url
    response = client.get("/calendar/events.json?start=2030-01-01T00:00:00Z&end=2030-01-02T00:00:00Z")
    assert response.status_code == 401 and response.json()["code"] == "not_authenticated"


def test_sign_in_requires_the_csrf_token(world):
    client = Client(enforce_csrf_checks=True)
    assert _post_login(client, "alpha-lead", PASSWORD).status_code == 403
    page = client.get("/accounts/login/")
    token = page.cookies["csrftoken"].value
    response = _post_login(client, "alpha-lead", PASSWORD, csrfmiddlewaretoken=token)
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    # Signing out is a POST with the token too.
    assert client.get("/accounts/logout/").status_code == 405
    token = client.cookies["csrftoken"].value
    assert client.post("/accounts/logout/", {"csrfmiddlewaretoken": token}).status_code == 302
    assert client.get("/").status_code == 302


def test_sign_in_keeps_the_browsers_time_zone_and_rejects_unknown_ones(world, client):
    _post_login(client, "alpha-lead", PASSWORD, tz="America/New_York")
    assert client.session["portal_tz"] == "America/New_York"
    assert b"Times are shown in <a href=\"/account/\">America/New_York</a>" in client.get("/").content
    other = Client()
    _post_login(other, "alpha-lead", PASSWORD, tz="Mars/Olympus_Mons")
    assert "portal_tz" not in other.session


def test_repeated_failures_lock_the_username_even_for_the_right_password(world, client, settings):
    settings.PORTAL_LOGIN_MAX_FAILURES = 5
    for _ in range(4):
        response = _post_login(client, "alpha-lead", "wrong")
        assert response.status_code == 200 and b"Please enter a correct username" in response.content
    response = _post_login(client, "alpha-lead", "wrong")  # the fifth failure locks
    response = _post_login(client, "alpha-lead", PASSWORD)
    assert response.status_code == 429
    assert b"Too many failed sign-in attempts" in response.content
    assert "_auth_user_id" not in client.session
    # Another user from another session is not affected by alpha-lead's lock.
    assert _post_login(Client(REMOTE_ADDR="10.0.0.9"), "beta-lead", PASSWORD).status_code == 302
    # When the lock expires (here: removed), the right password works again and resets the count.
    cache.delete(tenant_forms._key("lock-user", "alpha-lead"))
    assert _post_login(client, "alpha-lead", PASSWORD).status_code == 302


def test_many_usernames_from_one_address_lock_the_address(world, settings):
    settings.PORTAL_LOGIN_MAX_FAILURES_PER_IP = 3
    client = Client()
    for name in ("nobody", "alpha-member", "beta-lead"):
        _post_login(client, name, "wrong")
    response = _post_login(client, "alpha-lead", PASSWORD)
    assert response.status_code == 429


def test_successful_sign_in_resets_the_failure_count(world, client, settings):
    settings.PORTAL_LOGIN_MAX_FAILURES = 3
    _post_login(client, "alpha-lead", "wrong")
    _post_login(client, "alpha-lead", "wrong")
    assert _post_login(client, "alpha-lead", PASSWORD).status_code == 302
    other = Client()
    _post_login(other, "alpha-lead", "wrong")
    _post_login(other, "alpha-lead", "wrong")
    assert _post_login(other, "alpha-lead", PASSWORD).status_code == 302


def test_tenant_switcher_lists_only_own_tenants_and_switches(world, multi_tenant_user, web):
    client = web("alpha-lead")
    page = client.get("/").content.decode()
    assert 'id="tenant-select"' in page and "Team Alpha" in page and "Team Beta" in page
    assert 'data-role="lead"' in page and "Book nodes" in page

    response = client.post("/tenant/switch/", {"tenant": "beta", "next": "/calendar/"})
    assert response.status_code == 302 and response["Location"] == "/calendar/"
    page = client.get("/").content.decode()
    assert "<h1 style=\"margin:0\">Team Beta</h1>" in page
    assert 'data-role="viewer"' in page and "Book nodes" not in page  # viewer in beta: read only

    # A user with one tenant gets no switcher, and cannot switch into a foreign tenant.
    solo = web("alpha-member")
    assert 'id="tenant-select"' not in solo.get("/").content.decode()
    solo.post("/tenant/switch/", {"tenant": "beta"})
    assert "Team Beta" not in solo.get("/").content.decode()


def test_time_zone_can_be_chosen_on_the_account_page(world, web):
    client = web("alpha-member")
    assert client.post("/account/", {"tz": "Asia/Kolkata"}).status_code == 302
    assert client.session["portal_tz"] == "Asia/Kolkata"
    assert client.post("/account/", {"tz": "Not/AZone"}).status_code == 200
    assert client.session["portal_tz"] == "Asia/Kolkata"


def test_fleet_link_and_page_are_for_staff_only(world, web):
    assert b'href="/fleet/"' not in web("alpha-lead").get("/").content
    assert web("alpha-lead").get("/fleet/").status_code == 403
    staff = web("staff")
    assert b'href="/fleet/"' in staff.get("/").content
    assert staff.get("/fleet/").status_code == 200


def test_change_controls_follow_the_role_in_the_reservations_tenant(world, multi_tenant_user, web, book, t0):
    """alpha-lead is a viewer of beta: beta's bookings show no extend/cancel controls to them, whichever
    tenant is current, and alpha's do; beta-lead sees them on beta's."""
    beta_run = book("beta-lead", t0, name="beta-run")
    alpha_run = book("alpha-lead", t0 + timedelta(hours=4), name="alpha-run")
    client = web("alpha-lead")
    for current in ("alpha", "beta"):
        client.post("/tenant/switch/", {"tenant": current, "next": "/"})
        for path in ("/reservations/{}/", "/reservations/{}/panel/"):
            beta_page = client.get(path.format(beta_run.pk)).content.decode()
            alpha_page = client.get(path.format(alpha_run.pk)).content.decode()
            assert f"/reservations/{beta_run.pk}/extend/" not in beta_page, (current, path)
            assert f"/reservations/{beta_run.pk}/cancel/" not in beta_page, (current, path)
            assert f"/reservations/{alpha_run.pk}/extend/" in alpha_page, (current, path)
    assert f"/reservations/{beta_run.pk}/extend/" in web("beta-lead").get(
        f"/reservations/{beta_run.pk}/").content.decode()
    assert f"/reservations/{beta_run.pk}/extend/" not in web("beta-viewer").get(
        f"/reservations/{beta_run.pk}/").content.decode()


def test_the_lockout_message_counts_its_minutes_in_words(world, client, settings):
    """"Try again in 1 minute(s)." now reads "1 minute" (and "15 minutes")."""
    settings.PORTAL_LOGIN_MAX_FAILURES = 2
    for lockout, words in ((60, b"Try again in 1 minute."), (900, b"Try again in 15 minutes.")):
        settings.PORTAL_LOGIN_LOCKOUT_SECONDS = lockout
        forget_sign_in_failures()  # the previous round's lock; only these keys, the Redis db is shared
        for _ in range(2):
            _post_login(client, "alpha-lead", "wrong")
        response = _post_login(client, "alpha-lead", PASSWORD)
        assert response.status_code == 429 and words in response.content, response.content
