"""PORTAL_HEALTH_MOVE_BOOKINGS reads a boolean the way every other boolean setting does."""


from __future__ import annotations

import pytest
from django.conf import settings

from provisioning.health import services


@pytest.mark.parametrize(("raw", "moves"), [
    ("on", True), (" true ", True), ("Yes", True), ("1", True), ("y", True), ("", True),
    ("off", False), ("false", False), ("0", False), ("no", False),
])
def test_move_bookings_switch_from_the_environment(monkeypatch, raw, moves):
    assert not hasattr(settings, "PORTAL_HEALTH_MOVE_BOOKINGS")
    monkeypatch.setenv("PORTAL_HEALTH_MOVE_BOOKINGS", raw)
    calls = []
    monkeypatch.setattr(services, "node_replace_allocations", lambda **kw: calls.append(kw) or [{"moved": 1}])
    outcome = services._move_bookings(node=object(), actor=None, reason="check failed")
    assert (outcome == [{"moved": 1}]) is moves and len(calls) == int(moves)


def test_call_time_booleans_read_like_the_settings_modules():
    import environ

    from portal.core.conf import TRUE_STRINGS

    assert TRUE_STRINGS == set(environ.Env.BOOLEAN_TRUE_STRINGS)
