"""Deliveries keep one row per channel however long the event key, and the log shows names as typed (found in a
review of the notifications)."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from notifications import services

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"


def test_long_hostnames_do_not_collapse_deliveries_of_different_channels(world, t0, book, slack_for, webhook_for):
    # Node.hostname allows 253 characters; Delivery.key is notice.key + "|c<channel>" cut to 255.
    slack = slack_for("alpha", SLACK_URL)
    hook, _ = webhook_for("alpha", "https://ci.alpha.example/hook")
    reservation = book("alpha", t0)
    failed, spare = "a" * 120 + ".gpu.example", "b" * 120 + ".gpu.example"

    created = services.event_fanout(event="node.replaced", payload={
        "reservation_id": reservation.pk, "tenant_id": reservation.tenant_id,
        "failed": failed, "spare": spare, "reason": "xid 79"})

    # Both of alpha's channels subscribe to node.replaced (the defaults): two messages expected.
    assert sorted(d.channel_id for d in created) == sorted([slack.pk, hook.pk])


def test_delivery_log_shows_the_name_as_typed_not_slack_escaped(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    reservation = book("alpha", t0, name="R&D <llm>")
    services.event_fanout(event="reservation.confirmed",
                          payload={"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id})
    client = Client()
    client.force_login(world.users["alpha-lead"])
    html = client.get(reverse("notifications:deliveries")).content.decode()
    # Django escapes once: "R&amp;D &lt;llm&gt;" renders as "R&D <llm>". Escaped twice it renders "R&amp;D &lt;llm&gt;".
    assert "R&amp;D &lt;llm&gt;" in html and "R&amp;amp;D" not in html

