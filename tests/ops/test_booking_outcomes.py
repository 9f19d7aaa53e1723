"""portal_booking_requests_total{outcome} counts every answer POST /api/v1/reservations/ gives,
under the envelope code the client got (DESIGN §6), including refusals DRF makes before the view
method runs (authentication, throttling) and bodies that do not parse."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings

from portal.ops import metrics
from tests.conftest import forget_throttle_budgets

pytestmark = pytest.mark.django_db

URL = "/api/v1/reservations/"


def counts() -> dict[str, float]:
    return {o: metrics.REGISTRY.get_sample_value("portal_booking_requests_total", {"outcome": o}) or 0.0
            for o in metrics.BOOKING_OUTCOMES}


def delta(before: dict[str, float]) -> dict[str, float]:
    after = counts()
    return {o: after[o] - before[o] for o in after if after[o] != before[o]}


def body(t0, **over):
    return {"tenant": "alpha", "pool": "h100", "node_count": 1, "start": t0.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "end": (t0 + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ"), **over}


def test_every_booking_answer_is_counted_under_the_code_the_client_got(ops, world, t0):
    forget_throttle_budgets(world.users["alpha-lead"])
    before = counts()
    anonymous = world.client(None).post(URL, body(t0), format="json")
    assert anonymous.status_code == 401 and anonymous.json()["code"] == "not_authenticated"
    assert delta(before) == {"not_authenticated": 1}

    before = counts()
    malformed = world.client("alpha-lead").post(URL, b'{"tenant": ', content_type="application/json")
    assert malformed.status_code == 400 and malformed.json()["code"] == "invalid"
    assert delta(before) == {"invalid": 1}  # what the client was told, not a server "error"

    before = counts()
    with override_settings(PORTAL_THROTTLE_USER="1/min"):
        client = world.client("alpha-lead")
        assert client.post(URL, body(t0), format="json").status_code == 201
        throttled = client.post(URL, body(t0 + timedelta(hours=4)), format="json")
    assert throttled.status_code == 429 and throttled.json()["code"] == "throttled"
    assert delta(before) == {"created": 1, "throttled": 1}


def test_an_idempotent_replay_is_not_counted_as_a_second_booking(ops, world, t0):
    forget_throttle_budgets(world.users["alpha-lead"])
    client = world.client("alpha-lead")
    before = counts()
    first = client.post(URL, body(t0), format="json", HTTP_IDEMPOTENCY_KEY="retry-after-timeout-1")
    again = client.post(URL, body(t0), format="json", HTTP_IDEMPOTENCY_KEY="retry-after-timeout-1")
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    # One reservation was made: "Bookings created" must say 1; the retry is counted apart.
    assert delta(before) == {"created": 1, "replayed": 1}


def test_an_accept_header_the_api_cannot_serve_is_a_client_refusal_not_a_server_error(ops, world, t0):
    """A 406 is the client's doing: counted under its envelope code, like 400/401/429, never as
    "error" (the 5xx outcome an operator is paged on)."""
    forget_throttle_budgets(world.users["alpha-lead"])
    before = counts()
    refused = world.client("alpha-lead").post(URL, body(t0), format="json", HTTP_ACCEPT="application/xml")
    assert refused.status_code == 406 and refused.json()["code"] == "not_acceptable"
    assert delta(before) == {"not_acceptable": 1}
    assert metrics.REGISTRY.get_sample_value("portal_booking_duration_seconds_count",
                                             {"outcome": "not_acceptable"}) >= 1
