"""The notifier's tuning settings come from the environment too, as every other setting does."""

from __future__ import annotations

import pytest
from django.conf import settings

from notifications import services


@pytest.mark.parametrize(("name", "read", "value"), [
    ("PORTAL_NOTIFY_HTTP_DEADLINE", services.http_deadline, 7.5),
    ("PORTAL_NOTIFY_LEASE_SECONDS", services.lease_seconds, 45.0),
    ("PORTAL_NOTIFY_BACKOFF_BASE", services._backoff_base, 5.0),
    ("PORTAL_NOTIFY_BACKOFF_CAP", services._backoff_cap, 120.0),
    ("PORTAL_NOTIFY_MIN_INTERVAL", services._min_interval, 0.5),
    ("PORTAL_NOTIFY_RETRY_HOURS", lambda: services.retry_window().total_seconds() / 3600, 6.0),
])
def test_a_setting_given_only_in_the_environment_is_used(monkeypatch, name, read, value):
    assert not hasattr(settings, name), f"{name} is now a Django setting; this test no longer covers the environment"
    before = read()
    monkeypatch.setenv(name, str(value))
    assert read() == value != before
    monkeypatch.setenv(name, "")  # empty counts as unset
    assert read() == before
