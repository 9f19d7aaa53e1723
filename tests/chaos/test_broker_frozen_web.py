"""A write still answers when the broker hangs instead of refusing: a frozen Redis (paused, swapped out, a
network path that drops packets) accepts the connection and never replies.

The web process publishes its tasks after the commit and logs a broker error instead of raising it
(tests/chaos/test_broker_down_web.py), but the broker connection had no socket timeout: the publish waited
for Redis's reply for ever, and so did the user's request, until gunicorn killed the worker (a 502 for a
change that had committed, and a web worker gone for each request made meanwhile).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from notifications.models import Delivery

pytestmark = [pytest.mark.django_db(transaction=True)]

# Bounded by the broker's socket timeout times the publish's tries; far below gunicorn's 30 s.
ANSWER_WITHIN_S = 25


def test_a_write_answers_while_the_broker_is_frozen(world, receiver, webhook_for, private_redis):
    channel, _ = webhook_for("alpha", receiver.url("/hook"))
    client = Client(raise_request_exception=False)
    client.force_login(world.users["alpha-lead"])
    answer: dict = {}

    def post() -> None:
        try:
            answer["status"] = client.post(reverse("notifications:channel-test", args=[channel.pk])).status_code
        finally:
            connection.close()

    os.kill(private_redis.proc.pid, signal.SIGSTOP)  # Redis hangs: connections open, no replies
    try:
        request = threading.Thread(target=post, daemon=True)
        request.start()
        request.join(ANSWER_WITHIN_S)
        assert not request.is_alive(), f"the request still waits for the frozen broker after {ANSWER_WITHIN_S} s"
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
        request.join(30)
    assert answer["status"] == 302
    assert Delivery.objects.filter(channel=channel).count() == 1  # committed: the sweeper will send it
