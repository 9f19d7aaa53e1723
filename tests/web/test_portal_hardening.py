"""Browser pages answering hostile or odd input: no 500s, no secrets left in caches."""

from __future__ import annotations

import pytest

from portal.core.models import AuditLog

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("value", ["²", "٣", "1" * 5000])
def test_audit_tenant_filter_that_is_no_tenant_id_is_ignored_not_a_500(world, web, value):
    """str.isdigit() is true for "²" (int() refuses it) and for 5000 digits (over Python's int() limit):
    the audit page answered 500 to ?tenant=² instead of ignoring a filter naming none of the lead's tenants."""
    AuditLog.objects.create(action="quota.update", object_type="tenants.quota", object_id="1",
                            tenant_id=world.tenants["alpha"].pk)
    response = web("alpha-lead", raise_request_exception=False).get("/audit/", {"tenant": value})
    assert response.status_code == 200
    assert 'data-action="quota.update"' in response.content.decode()


@pytest.mark.parametrize("next_url", ["/accounts/login/", "http://testserver/accounts/login/"])
def test_signed_in_user_sent_to_sign_in_with_next_back_to_it_gets_the_dashboard_not_a_500(world, web, next_url):
    """Django's LoginView (redirect_authenticated_user) raises ValueError("Redirection loop …") when next is
    the sign-in page itself: a link /accounts/login/?next=/accounts/login/ answered every signed-in user 500."""
    response = web("alpha-member", raise_request_exception=False).get("/accounts/login/", {"next": next_url})
    assert response.status_code == 302 and response["Location"] == "/"


def test_signing_in_with_next_back_to_the_sign_in_page_lands_on_the_dashboard(world, client):
    page = client.get("/accounts/login/", {"next": "/accounts/login/"})
    assert page.status_code == 200
    response = client.post("/accounts/login/?next=/accounts/login/",
                           {"username": "alpha-member", "password": "pw-Long-enough-1", "next": "/accounts/login/"})
    assert response.status_code == 302 and response["Location"] == "/"


def test_the_dashboard_that_shows_a_calendar_feed_address_is_never_cached(world, web):
    """The feed address is a credential (it opens the tenant's calendar without signing in), yet the dashboard
    carrying it had no Cache-Control: a browser's disk cache or a proxy could keep it after signing out, where
    the account page (a new API token) and the notification settings (a signing secret) send no-store."""
    from tests.conftest import feed_path

    alpha = world.tenants["alpha"]
    alpha.ical_token = "alpha-token-aaaaaaaaaaaa"
    alpha.save()
    response = web("alpha-viewer").get("/")
    assert feed_path(alpha, world.users["alpha-viewer"]) in response.content.decode()
    cache_control = response.get("Cache-Control", "")
    assert "no-store" in cache_control and "private" in cache_control, cache_control
