"""transport.post against a real loopback receiver: every answer Slack or a tenant can give."""

from __future__ import annotations

import logging
import random
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
import requests

from notifications import transport
from notifications.transport import Outcome, Verdict, backoff, classify, parse_retry_after, post, redact_url
from portal.core import egress

from .receiver import (
    ACTION_PROHIBITED,
    CHANNEL_IS_ARCHIVED,
    CHANNEL_NOT_FOUND,
    INVALID_PAYLOAD,
    Reply,
    WebhookReceiver,
)

SECRET_PATH = "/services/T0AAAAAAA/B0BBBBBBB/s3cr3tT0k3nQQQQQQQQQQQQQ"
BODY = b'{"text":"hello"}'


def test_200_ok_is_delivered_and_the_request_arrives_intact(webhook_receiver: WebhookReceiver) -> None:
    outcome = post(webhook_receiver.url(SECRET_PATH), BODY, {"X-Extra": "1"}, timeout=5, slack=True)

    assert outcome == Outcome(Verdict.DELIVERED, 200, "", None, "ok", outcome.elapsed_s)
    assert outcome.delivered and not outcome.retryable and not outcome.permanent
    [request] = webhook_receiver.requests
    assert request.method == "POST"
    assert request.path == SECRET_PATH
    assert request.body == BODY
    assert request.headers["content-type"] == "application/json"
    assert request.headers["user-agent"] == transport.USER_AGENT
    assert request.headers["x-extra"] == "1"


def test_a_slack_2xx_without_ok_is_not_counted_as_delivered(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply(200, b"<html>captive portal</html>"))
    outcome = post(webhook_receiver.url(), BODY, timeout=5, slack=True)
    assert outcome.verdict is Verdict.PERMANENT
    assert outcome.error == "unexpected_response:http_200"


def test_any_2xx_delivers_a_tenant_webhook(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply(204, b""), Reply(202, b"queued"))
    assert post(webhook_receiver.url(), BODY, timeout=5, slack=False).verdict is Verdict.DELIVERED
    second = post(webhook_receiver.url(), BODY, timeout=5, slack=False)
    assert (second.verdict, second.status, second.body) == (Verdict.DELIVERED, 202, "queued")


def test_429_retries_after_the_seconds_slack_asks_for(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply.rate_limited(3))
    outcome = post(webhook_receiver.url(), BODY, timeout=5, slack=True)
    assert (outcome.verdict, outcome.status, outcome.error) == (Verdict.RETRY, 429, "rate_limited")
    assert outcome.retry_after == 3.0
    assert transport.retry_delay(outcome, attempt=5) == 3.0  # the server's wish beats backoff


def test_429_with_an_http_date_retry_after(webhook_receiver: WebhookReceiver) -> None:
    when = datetime.now(UTC) + timedelta(seconds=30)
    webhook_receiver.script(Reply.rate_limited(format_datetime(when, usegmt=True)))
    outcome = post(webhook_receiver.url(), BODY, timeout=5)
    assert outcome.verdict is Verdict.RETRY
    assert outcome.retry_after is not None
    assert 27 <= outcome.retry_after <= 30


def test_429_without_retry_after_falls_back_to_backoff(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply(429, b"rate_limited"))
    outcome = post(webhook_receiver.url(), BODY, timeout=5)
    assert outcome.verdict is Verdict.RETRY and outcome.retry_after is None
    delays = {transport.retry_delay(outcome, attempt=3, base_s=1, cap_s=100) for _ in range(50)}
    assert all(0 <= d <= 8 for d in delays) and len(delays) > 1


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (Reply.server_error(), "rollup_error"),  # Slack's 500 body
        (Reply(500, b"<html><body>Internal Server Error</body></html>"), "http_500"),
        (Reply(502, b""), "http_502"),
        (Reply(408, b""), "http_408"),
    ],
)
def test_5xx_and_408_are_transient(webhook_receiver: WebhookReceiver, reply: Reply, error: str) -> None:
    webhook_receiver.script(reply)
    outcome = post(webhook_receiver.url(), BODY, timeout=5, slack=True)
    assert (outcome.verdict, outcome.status, outcome.error, outcome.retry_after) == (
        Verdict.RETRY,
        reply.status,
        error,
        None,
    )


def test_503_with_retry_after_is_honoured(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply(503, b"maintenance", (("Retry-After", "120"),)))
    outcome = post(webhook_receiver.url(), BODY, timeout=5)
    assert (outcome.verdict, outcome.retry_after) == (Verdict.RETRY, 120.0)


def test_a_slow_receiver_times_out_and_is_retried(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply.slow(30.0))  # far past the bound: waiting for the answer can never pass
    started = time.monotonic()
    outcome = post(webhook_receiver.url(SECRET_PATH), BODY, timeout=0.5, slack=True)
    elapsed = time.monotonic() - started

    assert (outcome.verdict, outcome.status, outcome.error) == (Verdict.RETRY, None, "timeout")
    assert 0.4 <= elapsed < 2.5  # gave up at the client timeout, not when the server answered
    assert webhook_receiver.wait_for(1)[0].body == BODY  # it did reach the receiver


@pytest.mark.parametrize("own_session", [True, False], ids=["own session", "public session"])
def test_a_receiver_dripping_its_answer_is_cut_off_at_the_deadline(webhook_receiver: WebhookReceiver,
                                                                    own_session: bool) -> None:
    # Every byte comes within the read timeout, so only an overall deadline ends the exchange: the whole
    # answer (about 90 bytes, one each 0.1 s) would take some 9 s.
    webhook_receiver.script(Reply.dripping(0.1))
    started = time.monotonic()
    if own_session:
        outcome = post(webhook_receiver.url(SECRET_PATH), BODY, timeout=0.5, deadline=1.0, slack=True)
    else:
        with egress.public_session() as session:  # the tenants' URLs: every connection checked, and watched
            outcome = post(webhook_receiver.url(SECRET_PATH), BODY, timeout=0.5, deadline=1.0, slack=True,
                           session=session)
    elapsed = time.monotonic() - started

    assert (outcome.verdict, outcome.status, outcome.error) == (Verdict.RETRY, None, "timeout")
    assert 0.9 <= elapsed < 2.5
    assert webhook_receiver.wait_for(1)[0].body == BODY


def test_a_receiver_dripping_within_the_deadline_is_heard_out(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply.dripping(0.005))
    outcome = post(webhook_receiver.url(SECRET_PATH), BODY, timeout=0.5, deadline=10.0, slack=True)
    assert (outcome.verdict, outcome.status, outcome.body) == (Verdict.DELIVERED, 200, "ok")


def test_the_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="deadline"):
        post("http://127.0.0.1:9/", BODY, deadline=0)


def test_connection_refused_is_transient() -> None:
    receiver = WebhookReceiver().start()
    url = receiver.url(SECRET_PATH)
    receiver.stop()  # nothing listens on that port any more
    outcome = post(url, BODY, timeout=2)
    assert (outcome.verdict, outcome.status, outcome.error) == (Verdict.RETRY, None, "connection_error")


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (INVALID_PAYLOAD, "invalid_payload"),
        (ACTION_PROHIBITED, "action_prohibited"),
        (CHANNEL_NOT_FOUND, "channel_not_found"),
        (CHANNEL_IS_ARCHIVED, "channel_is_archived"),
        (Reply.slack_error(404, "no_service"), "no_service"),
        (Reply.slack_error(404, "no_team"), "no_team"),
        (Reply.slack_error(403, "invalid_token"), "invalid_token"),
        (Reply.slack_error(403, "posting_to_general_channel_denied"), "posting_to_general_channel_denied"),
        (Reply(401, b"<h1>Unauthorized</h1>"), "http_401"),
        (Reply(422, b""), "http_422"),
    ],
)
def test_4xx_is_permanent_with_slacks_error_string(webhook_receiver: WebhookReceiver, reply: Reply, error: str) -> None:
    webhook_receiver.script(reply)
    outcome = post(webhook_receiver.url(), BODY, timeout=5, slack=True)
    assert (outcome.verdict, outcome.status, outcome.error) == (Verdict.PERMANENT, reply.status, error)
    assert outcome.retry_after is None
    assert len(webhook_receiver.requests) == 1  # nothing was retried behind our back


def test_slack_error_strings_listed_in_the_brief_are_known() -> None:
    assert {
        "invalid_payload",
        "action_prohibited",
        "channel_not_found",
        "channel_is_archived",
        "no_service",
        "no_team",
        "invalid_token",
        "posting_to_general_channel_denied",
    } <= transport.SLACK_PERMANENT_ERRORS


def test_redirects_are_not_followed(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply.redirect(webhook_receiver.url("/elsewhere")))
    outcome = post(webhook_receiver.url(), BODY, timeout=5)
    assert (outcome.verdict, outcome.status, outcome.error) == (Verdict.PERMANENT, 302, "redirect_not_followed")
    assert [r.path for r in webhook_receiver.requests] == ["/hook"]  # /elsewhere never got the body


def test_a_huge_error_body_is_cut_to_an_excerpt(webhook_receiver: WebhookReceiver) -> None:
    webhook_receiver.script(Reply(400, b"x" * 200_000))
    outcome = post(webhook_receiver.url(), BODY, timeout=5)
    assert outcome.permanent and outcome.error == "http_400"
    assert outcome.body == "x" * transport.MAX_BODY_EXCERPT


@pytest.mark.parametrize("url", ["not a url", "ftp://example.com/hook", "http://"])
def test_unusable_urls_are_permanent(url: str) -> None:
    outcome = post(url, BODY, timeout=2)
    assert (outcome.verdict, outcome.error) == (Verdict.PERMANENT, "invalid_url")


def test_a_shared_session_is_reused(webhook_receiver: WebhookReceiver) -> None:
    with requests.Session() as session:
        outcomes = [post(webhook_receiver.url(), BODY, timeout=5, slack=True, session=session) for _ in range(3)]
    assert [o.verdict for o in outcomes] == [Verdict.DELIVERED] * 3
    assert len(webhook_receiver.requests) == 3


def test_the_webhook_url_never_reaches_the_logs(
    webhook_receiver: WebhookReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    webhook_receiver.script(Reply.slow(2.0), CHANNEL_NOT_FOUND, Reply.ok())
    url = webhook_receiver.url(SECRET_PATH + "?token=abc")
    caplog.set_level(logging.DEBUG)  # urllib3 logs the request line at DEBUG; include it

    outcomes = [post(url, BODY, timeout=0.5, slack=True) for _ in range(3)]

    assert [o.verdict for o in outcomes] == [Verdict.RETRY, Verdict.PERMANENT, Verdict.DELIVERED]
    ours = [r for r in caplog.records if r.name == transport.logger.name]
    assert len(ours) == 3
    assert all(redact_url(url) in r.getMessage() for r in ours)
    for record in ours:
        assert "s3cr3t" not in record.getMessage() and "token=abc" not in record.getMessage()
    for outcome in outcomes:
        assert "s3cr3t" not in repr(outcome)


def test_redact_url_keeps_the_host_and_hides_the_secret() -> None:
    slack = "https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/s3cr3tT0k3n"
    redacted = redact_url(slack)
    assert redacted.startswith("https://hooks.slack.com/…#")
    assert "T0AAAAAAA" not in redacted and "s3cr3t" not in redacted
    assert redact_url(slack) == redacted  # stable, so log lines can be matched up
    assert redact_url(slack + "x") != redacted

    assert redact_url("https://user:pa55@example.com:8443/hook?sig=1").startswith("https://example.com:8443/…#")
    assert "pa55" not in redact_url("https://user:pa55@example.com/hook")
    assert redact_url("http://[::1]:9000/x").startswith("http://[::1]:9000/…#")
    assert redact_url("garbage").startswith("<invalid url #")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120.0),
        (" 5 ", 5.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("-3", 0.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # in the past: go now
        ("soon", None),
        ("", None),
        (None, None),
        ("nan", None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value) == expected


def test_parse_retry_after_http_date_relative_to_now() -> None:
    now = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("Tue, 01 Jan 2030 12:01:30 GMT", now=now) == 90.0


def test_backoff_stays_within_full_jitter_bounds() -> None:
    rng = random.Random(1234)
    for attempt in range(15):
        ceiling = min(60.0, 1.0 * 2**attempt)
        samples = [backoff(attempt, base_s=1.0, cap_s=60.0, rng=rng) for _ in range(400)]
        assert all(0.0 <= s <= ceiling for s in samples)
        # Full jitter spreads over the whole range rather than clustering at the top.
        assert min(samples) < 0.1 * ceiling and max(samples) > 0.9 * ceiling
    assert backoff(10_000, cap_s=30.0) <= 30.0  # no overflow for absurd attempt numbers


def test_backoff_rejects_negative_attempts() -> None:
    with pytest.raises(ValueError):
        backoff(-1)


def test_classify_without_a_socket() -> None:
    assert classify(200, "ok", slack=True).delivered
    assert classify(200, "whatever", slack=False).delivered
    assert classify(429, "", {"retry-after": "7"}).retry_after == 7.0
    assert classify(404, "channel_not_found\n", slack=True).error == "channel_not_found"
    assert classify(301, "").error == "redirect_not_followed"
