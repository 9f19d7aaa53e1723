"""Comma-separated list settings ignore spaces around the commas and empty entries.

ALLOWED_HOSTS="a.com, b.com" must allow "b.com", not " b.com" (which would answer every request to
b.com with a 400). Settings are imported in a fresh interpreter with the environment under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cryptography.fernet import Fernet

from .test_production import ROOT, production_env

READ = (
    "import json; import django; from django.conf import settings as s; django.setup();"
    "print(json.dumps({'hosts': s.ALLOWED_HOSTS, 'origins': s.CSRF_TRUSTED_ORIGINS,"
    "'keys': s.PORTAL_FERNET_KEYS, 'slack': s.PORTAL_PLATFORM_SLACK_EVENTS,"
    "'networks': s.PORTAL_METRICS_ALLOWED_NETWORKS, 'admins': [a for _, a in s.ADMINS]}))"
)


def _settings(module: str, **environment) -> dict:
    env = production_env(DJANGO_SETTINGS_MODULE=module, **environment)
    result = subprocess.run([sys.executable, "-c", READ], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("module", ["portal.settings.production", "portal.settings.dev"])
def test_list_settings_strip_spaces_and_drop_empty_entries(module):
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    s = _settings(
        module,
        ALLOWED_HOSTS=" portal.example.com, b.example.com ,,127.0.0.1, ",
        CSRF_TRUSTED_ORIGINS="https://portal.example.com, https://b.example.com,",
        PORTAL_FERNET_KEYS=f"{key_a}, {key_b} ",
        PORTAL_PLATFORM_SLACK_EVENTS="booking.created, booking.cancelled , ",
        PORTAL_METRICS_ALLOWED_NETWORKS="10.0.0.0/8, 192.0.2.0/24,",
        ADMIN_EMAILS="ops@example.com, oncall@example.com",
    )
    assert s["hosts"] == ["portal.example.com", "b.example.com", "127.0.0.1"]
    assert s["origins"] == ["https://portal.example.com", "https://b.example.com"]
    assert s["keys"] == [key_a, key_b]
    assert s["slack"] == ["booking.created", "booking.cancelled"]
    assert s["networks"] == ["10.0.0.0/8", "192.0.2.0/24"]
    if module.endswith("production"):
        assert s["admins"] == ["ops@example.com", "oncall@example.com"]


def test_a_list_of_only_spaces_is_empty():
    s = _settings("portal.settings.dev", CSRF_TRUSTED_ORIGINS=" , ", PORTAL_PLATFORM_SLACK_EVENTS=" ")
    assert s["origins"] == [] and s["slack"] == []
