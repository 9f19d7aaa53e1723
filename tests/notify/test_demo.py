"""`make run` with PORTAL_DEMO_WEBHOOK_URL: the demo tenant's events go to a local receiver."""

from __future__ import annotations

import pytest
import requests
from django.conf import settings

from notifications import services, signing
from notifications.choices import ChannelKind
from notifications.models import Channel
from portal.core.models import AuditLog

from .conftest import start_receiver_command
from .test_worker import database_url, wait_for


@pytest.mark.django_db
def test_demo_channel_is_created_from_the_environment(world, t0, book, notify_settings, receiver):
    notify_settings.PORTAL_DEMO_WEBHOOK_URL = receiver.url("/demo")
    notify_settings.PORTAL_DEMO_TENANT = "alpha"
    services._demo_ready.clear()
    reservation = book("alpha", t0)
    created = services.event_fanout(event="reservation.confirmed", payload={"reservation_id": reservation.pk})
    channel = Channel.objects.get(tenant=world.tenants["alpha"], kind=ChannelKind.WEBHOOK, name="demo")
    assert [d.channel for d in created] == [channel]
    assert AuditLog.objects.filter(action="notifications.webhook.create", object_id=str(channel.pk)).exists()
    assert services.delivery_send(delivery_id=created[0].pk).posted
    assert receiver.wait_for(1)[0].path == "/demo"
    services._demo_ready.clear()  # the next test's settings differ


@pytest.mark.django_db(transaction=True)
def test_receiver_command_verifies_signed_requests(world, webhook_for, tmp_path):
    channel, secret = webhook_for("alpha", "http://127.0.0.1:1/unused")
    log = tmp_path / "receiver.log"
    proc, port = start_receiver_command(log, DATABASE_URL=database_url(), REDIS_URL=settings.REDIS_URL)
    try:
        body = b'{"id":"msg_1","type":"test","timestamp":"2026-01-01T00:00:00Z","data":{}}'
        good = requests.post(f"http://127.0.0.1:{port}/hook", data=body, timeout=5,
                             headers=signing.sign_headers(secret, body, msg_id="msg_1"))
        bad = requests.post(f"http://127.0.0.1:{port}/hook", data=body, timeout=5,
                            headers=signing.sign_headers(signing.generate_secret(), body, msg_id="msg_2"))
        assert good.status_code == bad.status_code == 200 and good.text == "ok"
        wait_for(lambda: "msg_2" in log.read_text(), what="output")
        text = log.read_text()
        assert "msg_1 signature ok" in text and "msg_2 signature BAD" in text
    finally:
        proc.terminate()
        proc.wait(10)

