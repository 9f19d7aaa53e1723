"""Personal API tokens on the account page: made (shown once), listed, revoked — by their own user only."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from portal.core.exceptions import InvalidState
from portal.core.models import AuditLog
from tenants import services as tenant_services
from tenants.models import ApiToken
from tenants.selectors import api_tokens_live

pytestmark = pytest.mark.django_db

TOKEN_RE = re.compile(r'value="(gpp_[A-Za-z0-9_-]+)"')


def _create(client: Client, **data):
    return client.post("/account/tokens/", {"name": "nightly", "expires": "90", **data})


def _api(key: str, path: str = "/api/v1/reservations/"):
    return Client().get(path, HTTP_AUTHORIZATION=f"Bearer {key}")


def test_a_new_token_is_shown_once_works_and_is_stored_hashed(web, world):
    client = web("alpha-member")
    response = _create(client)
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    key = TOKEN_RE.search(response.content.decode()).group(1)
    token = ApiToken.objects.get(user=world.users["alpha-member"], name="nightly")
    assert token.key_hash == ApiToken.hash_key(key) and token.prefix == key[:12] and token.name == "nightly"
    assert timedelta(days=89, hours=23) < token.expires_at - timezone.now() <= timedelta(days=90)
    assert not ApiToken.objects.filter(key_hash=key).exists()  # never the plaintext

    # It acts as its user: alpha's reservations, not beta's.
    answer = _api(key)
    assert answer.status_code == 200, answer.content
    # The page lists it afterwards, never with its key again.
    page = client.get("/account/").content.decode()
    assert key not in page and token.prefix in page and "nightly" in page
    audit = AuditLog.objects.get(action="token.issue", object_id=str(token.pk))
    assert audit.actor == world.users["alpha-member"] and key not in str(audit.after)


@pytest.mark.parametrize("expires,days", [("30", 30), ("365", 365), ("never", None)])
def test_expiry_choices(web, world, expires, days):
    assert _create(web("alpha-viewer"), expires=expires).status_code == 200
    token = ApiToken.objects.get(user=world.users["alpha-viewer"], name="nightly")
    if days is None:
        assert token.expires_at is None
    else:
        assert timedelta(days=days - 1) < token.expires_at - timezone.now() <= timedelta(days=days)


@pytest.mark.parametrize("data,field", [
    ({"expires": "5"}, "expires"), ({"expires": ""}, "expires"), ({"expires": "99999"}, "expires"),
    ({"name": "x" * 101}, "name"), ({"name": "bad\x01name"}, "name"),
])
def test_bad_input_is_refused_and_nothing_is_made(web, world, data, field):
    before = ApiToken.objects.count()
    response = _create(web("alpha-lead"), **data)
    assert response.status_code == 400
    assert field in response.context["token_form"].errors
    assert ApiToken.objects.count() == before
    assert not TOKEN_RE.search(response.content.decode())


def test_revoke_own_token_stops_it_at_once(web, world):
    client = web("alpha-lead")
    key = TOKEN_RE.search(_create(client).content.decode()).group(1)
    token = ApiToken.objects.get(name="nightly")
    assert _api(key).status_code == 200
    response = client.post(f"/account/tokens/{token.pk}/revoke/")
    assert response.status_code == 302 and response["Location"].endswith("/account/#api-tokens")
    token.refresh_from_db()
    assert token.revoked
    assert _api(key).status_code == 401
    assert AuditLog.objects.filter(action="token.revoke", actor=world.users["alpha-lead"]).count() == 1
    page = client.get("/account/").content.decode()
    assert "revoked" in page and f"/account/tokens/{token.pk}/revoke/" not in page


def test_another_users_token_cannot_be_revoked(web, world):
    token, key = tenant_services.token_issue(user=world.users["beta-lead"], name="theirs")
    for who in ("alpha-lead", "beta-member", "staff"):
        response = web(who).post(f"/account/tokens/{token.pk}/revoke/", follow=True)
        assert "No such token." in response.content.decode()
    token.refresh_from_db()
    assert not token.revoked and _api(key).status_code == 200
    assert not AuditLog.objects.filter(action="token.revoke").exists()
    # Nor is it listed to anyone else.
    assert token.prefix not in web("alpha-lead").get("/account/").content.decode()


def test_signed_out_and_wrong_method(world):
    before = ApiToken.objects.count()
    anonymous = Client()
    response = _create(anonymous)
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    assert Client().get("/account/tokens/").status_code in (302, 405)
    assert ApiToken.objects.count() == before
    client = Client()
    client.force_login(world.users["alpha-lead"])
    assert client.get("/account/tokens/").status_code == 405


def test_at_most_the_live_limit(web, world, settings):
    user = world.users["alpha-member"]
    limit = tenant_services.MAX_LIVE_TOKENS
    for i in range(limit - 1 - api_tokens_live(user=user).count()):
        tenant_services.token_issue(user=user, name=f"t{i}")
    expired, _ = tenant_services.token_issue(user=user, name="old")
    ApiToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    revoked, _ = tenant_services.token_issue(user=user, name="gone")
    tenant_services.token_revoke(actor=user, token=revoked)
    client = web("alpha-member")
    assert _create(client).status_code == 200  # expired and revoked ones do not count: this is the 20th
    before = ApiToken.objects.count()
    response = _create(client)
    assert response.status_code == 409
    assert "revoke one you no longer use first" in response.content.decode()
    assert not TOKEN_RE.search(response.content.decode())
    assert ApiToken.objects.count() == before


@pytest.mark.django_db(transaction=True)
def test_two_tabs_taking_the_last_place_get_one_token():
    from tests.conftest import make_world

    world = make_world()
    user = world.users["alpha-member"]
    for i in range(tenant_services.MAX_LIVE_TOKENS - 1 - api_tokens_live(user=user).count()):
        tenant_services.token_issue(user=user, name=f"t{i}")
    barrier = threading.Barrier(4)
    results: list = []

    def issue() -> None:
        try:
            barrier.wait(30)
            results.append(tenant_services.token_issue_own(user=user, name="tab"))
        except InvalidState as exc:
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=issue) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 4
    assert sum(isinstance(r, tuple) for r in results) == 1, results
    assert ApiToken.objects.filter(user=user).count() == tenant_services.MAX_LIVE_TOKENS
