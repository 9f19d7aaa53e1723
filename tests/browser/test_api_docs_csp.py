"""The API documentation pages work under the production Content-Security-Policy: Redoc's search runs in a
Web Worker that Redoc starts from a blob: address, which script-src 'self' alone refuses (the search box
then finds nothing). The policy is the one production itself sends for the page, read from a process
running portal.settings.production."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]

# The production stack answering one GET with the test client (hashed static names need collectstatic's
# manifest, which a checkout lacks: plain static storage stands in; the policy does not depend on it).
_HEADER_OF = """
import sys, django
django.setup()
from django.test import Client, override_settings
from django.conf import settings
storages = {**settings.STORAGES,
            "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}
with override_settings(STORAGES=storages):
    response = Client(HTTP_HOST="portal.example.com").get(sys.argv[1], secure=True)
assert response.status_code == 200, response.status_code
print(response["Content-Security-Policy"])
"""


def production_csp(path: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "PORTAL_FERNET_KEYS")}
    env.update({"DJANGO_SETTINGS_MODULE": "portal.settings.production", "SECRET_KEY": secrets.token_urlsafe(50),
                "PORTAL_FERNET_KEYS": Fernet.generate_key().decode(), "ALLOWED_HOSTS": "portal.example.com",
                "PYTHONPATH": str(ROOT), "LOG_LEVEL": "ERROR"})
    result = subprocess.run([sys.executable, "-c", _HEADER_OF, path], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_redoc_search_finds_operations_under_the_production_csp(live_server, new_page):
    policy = production_csp("/api/redoc/")
    page = new_page()
    refused = []  # scripts and workers; Redoc's cdn.redoc.ly logo is refused on purpose (img-src)
    page.on("console", lambda msg: refused.append(msg.text)
            if "Content Security Policy" in msg.text and "image" not in msg.text else None)

    def with_csp(route):
        response = route.fetch()
        route.fulfill(response=response, headers={**response.headers, "content-security-policy": policy})

    page.route(f"{live_server.url}/api/redoc/", with_csp)
    page.goto(f"{live_server.url}/api/redoc/")
    page.get_by_placeholder("Search...").fill("reservation")
    expect(page.locator("[data-role='search:results'] li").first).to_be_visible()
    assert not refused, refused
