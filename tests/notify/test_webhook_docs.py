"""docs/webhooks.md tells a team what a signed webhook carries and how to verify it: both are checked here
against what the portal really sends (a real delivery to a real receiver)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from notifications import services
from notifications.choices import DeliveryStatus
from notifications.slack import Event

pytestmark = pytest.mark.django_db

DOC = Path(__file__).resolve().parents[2] / "docs" / "webhooks.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def _sent(world, t0, book, receiver, webhook_for, notify_settings):
    notify_settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.05
    _, secret = webhook_for("alpha", receiver.url("/ci/hook"))
    reservation = book("alpha", t0, nodes=2, name="llm-pretrain")
    (delivery,) = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    assert services.delivery_send(delivery_id=delivery.pk).status == DeliveryStatus.DELIVERED
    (request,) = receiver.wait_for(1)
    return secret, request


def test_the_documented_verification_example_verifies_what_the_portal_sends(
        world, t0, book, receiver, webhook_for, notify_settings):
    secret, request = _sent(world, t0, book, receiver, webhook_for, notify_settings)
    (example,) = [b for b in _blocks("python") if "def verify_webhook" in b]
    namespace: dict = {}
    exec(compile(example, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation's example
    verify_webhook = namespace["verify_webhook"]

    event = verify_webhook(secret, request.headers, request.body)

    assert event["type"] == Event.RESERVATION_CONFIRMED and event["id"] == request.headers["webhook-id"]
    # Header names in any case (frameworks hand them over capitalised).
    assert verify_webhook(secret, {k.title(): v for k, v in request.headers.items()}, request.body) == event
    with pytest.raises(ValueError, match="signature"):
        verify_webhook(secret, request.headers, request.body.replace(b"llm-pretrain", b"llm-pretrair"))
    old = {**request.headers, "webhook-timestamp": str(int(request.headers["webhook-timestamp"]) - 3600)}
    with pytest.raises(ValueError, match="timestamp"):
        verify_webhook(secret, old, request.body)


def test_the_documented_envelope_is_what_the_portal_sends(world, t0, book, receiver, webhook_for, notify_settings):
    _, request = _sent(world, t0, book, receiver, webhook_for, notify_settings)
    sent = request.json()
    (documented,) = [json.loads(b) for b in _blocks("json") if '"reservation.confirmed"' in b]

    assert set(documented) == set(sent) == {"id", "type", "timestamp", "data"}
    assert set(documented["data"]) == set(sent["data"])
    assert documented["type"] == sent["type"]
    for key in ("start", "end"):  # the documented time format
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", sent["data"][key])
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", documented["data"][key])
    # Every event the portal sends is named in the document.
    text = DOC.read_text(encoding="utf-8")
    assert [e for e in Event if f"`{e.value}`" not in text] == []
