"""/admin/login/ shares the portal's lockout, but the admin form's refusal of a non-staff user with the RIGHT
password (also code "invalid_login") is no guess: it must not lock that member out of the portal."""
from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client

from tenants import forms as tenant_forms

pytestmark = pytest.mark.django_db
PASSWORD = "pw-Long-enough-1"


@pytest.fixture(autouse=True)
def clean_lockout_keys():
    def clear():
        for kind in ("fail-user", "lock-user"):
            cache.delete(tenant_forms._key(kind, "alpha-member"))
        for kind in ("fail-ip", "lock-ip"):
            cache.delete(tenant_forms._key(kind, "127.0.0.1"))
    clear()
    yield
    clear()


def test_right_password_of_a_non_staff_user_at_the_admin_is_not_a_failed_guess(world):
    client = Client()
    for _ in range(tenant_forms.LOGIN_MAX_FAILURES):
        response = client.post("/admin/login/", {"username": "alpha-member", "password": PASSWORD,
                                                 "next": "/admin/"})
        assert response.status_code == 200  # refused: not staff
        assert "_auth_user_id" not in client.session
    response = client.post("/accounts/login/", {"username": "alpha-member", "password": PASSWORD})
    assert response.status_code == 302, f"the member was locked out of the portal ({response.status_code})"


def test_wrong_passwords_at_the_admin_still_count(world):
    client = Client()
    for _ in range(tenant_forms.LOGIN_MAX_FAILURES):
        client.post("/admin/login/", {"username": "alpha-member", "password": "wrong", "next": "/admin/"})
    assert client.post("/accounts/login/", {"username": "alpha-member", "password": PASSWORD}).status_code == 429
