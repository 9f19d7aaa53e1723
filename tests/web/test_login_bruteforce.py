"""Sign-in brute force: the admin form shares the lockout; behind the proxy it keys on the client address."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.cache import cache
from django.test import Client, override_settings

from tenants import forms as tenant_forms

pytestmark = pytest.mark.django_db

PASSWORD = "pw-Long-enough-1"
USERS = ("staff", "alpha-lead", "alpha-member", "probe-1", "probe-2", "probe-3")
IPS = ("127.0.0.1", "203.0.113.9", "198.51.100.7")


@pytest.fixture(autouse=True)
def clean_lockout_keys():
    def clear():
        for name in USERS:
            for kind in ("fail-user", "lock-user"):
                cache.delete(tenant_forms._key(kind, name))
        for ip in IPS:
            for kind in ("fail-ip", "lock-ip"):
                cache.delete(tenant_forms._key(kind, ip))

    clear()
    yield
    clear()


def test_admin_login_is_locked_after_repeated_failures(world):
    """/admin/login/ guards the most powerful accounts; it must not allow unlimited password guesses."""
    client = Client()
    for _ in range(tenant_forms.LOGIN_MAX_FAILURES + 3):
        response = client.post("/admin/login/", {"username": "staff", "password": "wrong-guess", "next": "/admin/"})
        assert response.status_code in (200, 429)
    # The right password, after the lockout threshold: refused like on /accounts/login/.
    response = client.post("/admin/login/", {"username": "staff", "password": PASSWORD, "next": "/admin/"})
    assert response.status_code != 302, "admin sign-in accepted a password after 8 failed guesses"
    assert "_auth_user_id" not in client.session


def test_admin_login_respects_a_lock_set_by_the_portal_login(world):
    client = Client()
    for _ in range(tenant_forms.LOGIN_MAX_FAILURES):
        client.post("/accounts/login/", {"username": "staff", "password": "wrong-guess"})
    assert client.post("/accounts/login/", {"username": "staff", "password": PASSWORD}).status_code == 429
    response = client.post("/admin/login/", {"username": "staff", "password": PASSWORD, "next": "/admin/"})
    assert response.status_code != 302, "the admin sign-in bypasses the portal's lockout"


@override_settings(
    REST_FRAMEWORK={**settings.REST_FRAMEWORK, "NUM_PROXIES": 1},
    PORTAL_LOGIN_MAX_FAILURES_PER_IP=3,
)
def test_per_address_lockout_behind_the_tls_proxy_locks_only_the_guesser(world):
    """Deployed behind the TLS proxy (.env.example: PORTAL_NUM_PROXIES=1) every request has the proxy's
    REMOTE_ADDR; the per-address lock must key on the client address, or one guesser locks everybody out."""
    attacker = Client(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="203.0.113.9")
    for name in ("probe-1", "probe-2", "probe-3"):
        attacker.post("/accounts/login/", {"username": name, "password": "wrong-guess"})
    victim = Client(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="198.51.100.7")
    response = victim.post("/accounts/login/", {"username": "alpha-lead", "password": PASSWORD})
    assert response.status_code == 302, f"a different client was locked out ({response.status_code})"
    # The guesser itself stays locked, whatever username it tries next.
    response = attacker.post("/accounts/login/", {"username": "alpha-member", "password": PASSWORD})
    assert response.status_code == 429


@pytest.mark.django_db(transaction=True)
def test_parallel_guesses_get_no_more_than_the_limit(monkeypatch):
    """Twenty guesses at once against a limit of five: only five passwords are ever checked.

    The password check is slowed down so every request is in flight before any has failed; a
    count taken only after the check would let all twenty through the lock check first.
    """
    import threading
    import time

    from django.contrib.auth.backends import ModelBackend
    from django.db import connection

    checked: list[str] = []
    lock = threading.Lock()

    def slow_authenticate(self, request, username=None, password=None, **kwargs):
        with lock:
            checked.append(password)
        time.sleep(0.5)
        return None  # a wrong password

    monkeypatch.setattr(ModelBackend, "authenticate", slow_authenticate)
    barrier = threading.Barrier(20)
    statuses: list[int] = []
    errors: list[BaseException] = []

    def guess(i: int) -> None:
        try:
            client = Client(REMOTE_ADDR="203.0.113.9")
            barrier.wait(30)
            response = client.post("/accounts/login/", {"username": "probe-1", "password": f"guess-{i}"})
            with lock:
                statuses.append(response.status_code)
        except BaseException as exc:  # noqa: BLE001 - reported below, with what the other guesses got
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(statuses) == 20, (errors, sorted(statuses))
    assert len(checked) == tenant_forms.LOGIN_MAX_FAILURES, f"{len(checked)} passwords checked; {sorted(statuses)}"
    assert statuses.count(429) == 20 - tenant_forms.LOGIN_MAX_FAILURES, sorted(statuses)
    # And the username is locked now, the right password included.
    assert tenant_forms.login_lock_remaining("probe-1", "203.0.113.9") > 0


def test_the_lockout_limit_set_in_the_environment_is_honoured(world, monkeypatch):
    """README lists PORTAL_LOGIN_MAX_FAILURES as a setting; settings come from the environment, so an
    operator's `PORTAL_LOGIN_MAX_FAILURES=2` in .env must lock after two guesses, not the default five."""
    assert not hasattr(settings, "PORTAL_LOGIN_MAX_FAILURES")
    monkeypatch.setenv("PORTAL_LOGIN_MAX_FAILURES", "2")
    client = Client()
    for _ in range(2):
        assert client.post("/accounts/login/", {"username": "alpha-lead", "password": "wrong-guess"}).status_code == 200
    assert client.post("/accounts/login/", {"username": "alpha-lead", "password": PASSWORD}).status_code == 429
