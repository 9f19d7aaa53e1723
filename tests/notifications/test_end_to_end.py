"""The pieces together, as the delivery task will use them, against the loopback receiver."""

from __future__ import annotations

import json
import time

import redis
from standardwebhooks.webhooks import Webhook

from notifications import ratelimit, signing, slack, transport
from notifications.transport import Verdict

from .receiver import CHANNEL_IS_ARCHIVED, Reply, WebhookReceiver
from .test_slack import SAMPLES


def test_slack_message_rate_limited_then_delivered(
    webhook_receiver: WebhookReceiver, redis_client: redis.Redis, redis_prefix: str
) -> None:
    url = webhook_receiver.url("/services/T0/B0/secret")
    key = ratelimit.key_for_url(url, prefix=redis_prefix)
    message = slack.build_message(slack.Event.CLUSTER_READY, SAMPLES[slack.Event.CLUSTER_READY], "https://p.example")

    # Slack says 429 once; the task waits what it asks, takes the slot again and succeeds.
    interval = 1.0  # Slack's one message per second per webhook
    webhook_receiver.script(Reply.rate_limited(1), Reply.ok())
    before, wall_before = time.monotonic(), time.time()  # before the first slot is taken
    assert ratelimit.acquire(redis_client, key, interval) == 0
    first = transport.post(url, slack.to_body(message), timeout=5, slack=True)
    assert first.verdict is Verdict.RETRY and first.retry_after == 1.0

    wait = ratelimit.acquire(redis_client, key, interval)
    since_first = time.monotonic() - before  # at least what passed on the server since the first slot
    if since_first < interval:
        # A second send inside the interval must wait, for the rest of it.
        assert interval - since_first - 0.002 <= wait <= interval, (wait, since_first)
    else:  # this machine stalled past the interval: the slot had freed, and the call took it
        assert wait == 0, (wait, since_first)
    assert ratelimit.acquire_blocking(redis_client, key, interval, timeout_s=5)
    second = transport.post(url, slack.to_body(message), timeout=5, slack=True)
    assert second.delivered

    received = webhook_receiver.wait_for(2)
    assert [r.json() for r in received] == [message, message]
    # The retry went out no sooner than an interval after the first slot was taken (which was
    # before the first message left); Redis and the receiver both count wall-clock time.
    assert received[1].received_at - wall_before >= interval - 0.002, received[1].received_at - wall_before


def test_permanent_slack_error_stops_the_attempts(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(CHANNEL_IS_ARCHIVED)
    message = slack.build_message(slack.Event.TEST, {"tenant": "research"}, "https://p.example")
    outcome = transport.post(webhook_receiver.url(), slack.to_body(message), timeout=5, slack=True)
    assert outcome.permanent and outcome.error == "channel_is_archived"


def test_signed_webhook_verifies_at_the_receiver_across_a_retry(webhook_receiver: WebhookReceiver) -> None:
    secret = signing.generate_secret()
    event = {"type": "reservation.confirmed", "data": {"id": 42}}
    body = json.dumps(event).encode()
    msg_id = signing.generate_message_id()
    webhook_receiver.script(Reply.server_error(b"oops"), Reply(204, b""))

    first = transport.post(
        webhook_receiver.url("/tenant/hook"), body, signing.sign_headers(secret, body, msg_id=msg_id), timeout=5
    )
    assert first.retryable and first.error == "oops"
    time.sleep(1.05)  # a retry is signed afresh: same id, new timestamp
    second = transport.post(
        webhook_receiver.url("/tenant/hook"), body, signing.sign_headers(secret, body, msg_id=msg_id), timeout=5
    )
    assert second.delivered

    requests = webhook_receiver.wait_for(2)
    assert {r.headers["webhook-id"] for r in requests} == {msg_id}
    assert requests[0].headers["webhook-timestamp"] != requests[1].headers["webhook-timestamp"]
    for request in requests:
        # What arrived on the wire verifies with the reference library and with ours.
        assert Webhook(secret).verify(request.body, request.headers) == event
        assert signing.verify(secret, request.body, request.headers) == msg_id
