"""Sign-in while Redis (the cache) is unreachable still works: the lockout counter (tenants/forms.py) logs the
cache error and lets the attempt through, as the API throttle on the same Redis does (docs/architecture.md,
"Rate limits"), instead of answering 500 to everyone."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def cache_down(settings, tmp_path):
    from tests.provisioning.conftest import RedisServer, free_port

    server = RedisServer(free_port(), tmp_path).start()
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": server.url}}
    server.stop()  # restarting / unreachable
    yield


@pytest.mark.parametrize("password", ["wrong-password", "right"])
def test_sign_in_with_the_cache_down_is_not_a_500(world, cache_down, password):
    user = world.users["alpha-lead"]
    if password == "right":
        user.set_password("right-pass-123")
        user.save()
        password = "right-pass-123"
    client = Client(raise_request_exception=False)
    response = client.post("/accounts/login/", {"username": user.username, "password": password})
    assert response.status_code in (200, 302), f"sign-in answered {response.status_code} with Redis down"
