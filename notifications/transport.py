"""POST one notification and classify the answer: delivered, retry later, or give up.

Used for both Slack incoming webhooks and tenants' signed webhooks. This module only
decides; the caller (the delivery task) records the Outcome and schedules the retry.

Rules (Slack: https://api.slack.com/changelog/2016-05-17-changes-to-errors-for-incoming-webhooks,
https://api.slack.com/docs/rate-limits):

- 2xx: delivered. Slack answers ``200 ok``; any other 2xx body from Slack is not a
  delivery we can vouch for, so it is recorded as permanent rather than retried
  (a retry might post the message twice).
- 429: retry after the ``Retry-After`` header (seconds or an HTTP-date), at most the backoff cap.
- 5xx, 408, timeouts, connection errors: transient; retry with ``backoff(attempt)``. A timeout is a
  socket operation's (``timeout``) or the whole exchange's (``deadline``: a receiver that drips its
  answer a byte at a time never trips the first).
- 3xx: never followed (a redirect would send the body and signature to a host the
  tenant did not register); permanent.
- any other 4xx (``invalid_payload``, ``channel_not_found``, ``no_service`` ...):
  permanent, with Slack's error string recorded so the integration can be marked broken.

A webhook URL is a bearer secret (anyone holding a Slack hook URL can post to the
channel), so it never goes into logs or outcomes: use ``redact_url``.
"""

from __future__ import annotations

import dataclasses
import email.utils
import enum
import hashlib
import logging
import math
import random
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from urllib.parse import urlsplit

import requests

from portal.core.deadline import DeadlineAdapter, within
from portal.core.egress import private_destination_of

__all__ = [
    "Verdict",
    "Outcome",
    "SLACK_PERMANENT_ERRORS",
    "post",
    "classify",
    "parse_retry_after",
    "backoff",
    "retry_delay",
    "redact_url",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
# The whole exchange, however the receiver paces its answer: a connect and one full read timeout.
DEFAULT_DEADLINE_S = 2 * DEFAULT_TIMEOUT_S
USER_AGENT = "gpu-portal-notifier/1"
# How much of a response body we keep: enough for Slack's error strings and a useful
# excerpt of a tenant's error page, never a whole HTML page in the delivery log.
MAX_BODY_BYTES = 2048
MAX_BODY_EXCERPT = 500

# Errors Slack documents (or reliable guides report) for incoming webhooks that no retry
# will fix. Any other 4xx is permanent too; this list only names what we expect to see.
SLACK_PERMANENT_ERRORS = frozenset(
    {
        "invalid_payload",
        "user_not_found",
        "action_prohibited",
        "channel_not_found",
        "channel_is_archived",
        "no_service",
        "no_team",
        "no_active_hooks",
        "invalid_token",
        "team_disabled",
        "posting_to_general_channel_denied",
        "too_many_attachments",
    }
)
# 408 is the server saying it gave up waiting for us: the next attempt may well succeed.
TRANSIENT_4XX = frozenset({408})

_ERROR_TOKEN = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class Verdict(enum.StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    PERMANENT = "permanent"


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What one POST attempt came to.

    ``error`` is a short machine-readable reason ('' when delivered): Slack's error string,
    ``http_<status>``, ``timeout``, ``connection_error`` ... ``retry_after`` is set only
    when the server said how long to wait (seconds, ≥ 0); otherwise the caller backs off.
    """

    verdict: Verdict
    status: int | None = None
    error: str = ""
    retry_after: float | None = None
    body: str = ""
    elapsed_s: float = 0.0

    @property
    def delivered(self) -> bool:
        return self.verdict is Verdict.DELIVERED

    @property
    def retryable(self) -> bool:
        return self.verdict is Verdict.RETRY

    @property
    def permanent(self) -> bool:
        return self.verdict is Verdict.PERMANENT


def redact_url(url: str) -> str:
    """Return url safe to log: scheme and host kept, the secret path and query replaced.

    A short fingerprint of the full URL is appended so two log lines about the same
    webhook can still be matched up without revealing it.
    """
    fingerprint = hashlib.sha256(url.encode("utf-8", "replace")).hexdigest()[:8]
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return f"<invalid url #{fingerprint}>"
    if not parts.scheme or not host:
        return f"<invalid url #{fingerprint}>"
    netloc = f"[{host}]" if ":" in host else host  # userinfo (user:password@) is dropped
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme}://{netloc}/…#{fingerprint}"


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Return the wait in seconds a ``Retry-After`` header asks for, or None if unusable.

    RFC 9110 allows delay-seconds (``"30"``) or an HTTP-date; a date in the past means 0.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        return float(int(value))
    try:
        # Slack sends integers, but a proxy in front of a tenant's receiver may send "1.5".
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000" parses naive; HTTP-dates are always GMT
        when = when.replace(tzinfo=UTC)
    current = now or datetime.now(UTC)
    return max(0.0, (when - current).total_seconds())


def backoff(attempt: int, *, base_s: float = 2.0, cap_s: float = 600.0, rng: random.Random | None = None) -> float:
    """Return a delay in seconds before retry number attempt (0 = the first retry).

    Full jitter (AWS architecture blog, "Exponential Backoff And Jitter"):
    uniform(0, min(cap, base·2^attempt)). The randomness spreads out workers that failed
    together (e.g. when Slack had an outage) so they do not all come back in the same second.
    """
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    # Clamp the exponent: 2**attempt overflows float for very large attempt numbers.
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt, 64))
    return (rng or random).uniform(0.0, ceiling)


def retry_delay(outcome: Outcome, attempt: int, *, base_s: float = 2.0, cap_s: float = 600.0) -> float:
    """Return how long to wait before the next attempt: the server's wish, else backoff; at most cap_s.

    The cap holds for Retry-After too: the answer comes from whatever sits at the tenant's URL, and a
    day (or an absurd number) would delay every later message, or overflow the next attempt's date.
    """
    if outcome.retry_after is not None:
        return min(outcome.retry_after, cap_s)
    return backoff(attempt, base_s=base_s, cap_s=cap_s)


def _error_token(body: str, status: int) -> str:
    # Slack answers with a bare token such as "channel_not_found"; a tenant's server may
    # answer with anything, and then the status code is the most useful name.
    first = body.strip().splitlines()[0].strip() if body.strip() else ""
    return first if _ERROR_TOKEN.match(first) else f"http_{status}"


def classify(status: int, body: str, headers: Mapping[str, str] | None = None, *, slack: bool = False) -> Outcome:
    """Classify an HTTP answer (status, body text, response headers) into an Outcome.

    slack=True additionally requires the body ``ok`` for a 2xx to count as delivered.
    """
    headers = headers or {}
    retry_after_header = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    excerpt = body[:MAX_BODY_EXCERPT]

    if 200 <= status < 300:
        if slack and body.strip() != "ok":
            error = _error_token(body, status)
            return Outcome(Verdict.PERMANENT, status, f"unexpected_response:{error}", body=excerpt)
        return Outcome(Verdict.DELIVERED, status, body=excerpt)
    if status == 429:
        return Outcome(Verdict.RETRY, status, "rate_limited", parse_retry_after(retry_after_header), excerpt)
    if status >= 500 or status in TRANSIENT_4XX:
        # A 503 may carry Retry-After too (maintenance); honour it when present.
        return Outcome(
            Verdict.RETRY, status, _error_token(body, status), parse_retry_after(retry_after_header), excerpt
        )
    if 300 <= status < 400:
        return Outcome(Verdict.PERMANENT, status, "redirect_not_followed", body=excerpt)
    if 400 <= status < 500:
        return Outcome(Verdict.PERMANENT, status, _error_token(body, status), body=excerpt)
    # 1xx cannot reach us through requests; anything else is not HTTP we understand.
    return Outcome(Verdict.PERMANENT, status, f"http_{status}", body=excerpt)


def _read_body(response: requests.Response) -> str:
    # Read a bounded prefix only: a misbehaving receiver must not make us buffer megabytes.
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_content(chunk_size=1024):
        chunks.append(chunk)
        size += len(chunk)
        if size >= MAX_BODY_BYTES:
            break
    return b"".join(chunks)[:MAX_BODY_BYTES].decode("utf-8", "replace")


def _watched_session() -> requests.Session:
    # A session of our own, as requests.post would make, whose connections the deadline watches.
    session = requests.Session()
    adapter = DeadlineAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    timeout: float | tuple[float, float] = DEFAULT_TIMEOUT_S,
    *,
    deadline: float = DEFAULT_DEADLINE_S,
    slack: bool | None = None,
    session: requests.Session | None = None,
) -> Outcome:
    """POST body to url once and return the classified Outcome; never raise for HTTP trouble.

    timeout is requests' (connect, read) timeout: each socket operation's. deadline bounds the whole
    exchange, connecting to the last byte of the answer (portal.core.deadline): a receiver still answering
    then, however steadily it drips, is cut off and the attempt is a ``timeout`` (retried). slack defaults
    to "the host is hooks.slack.com"; pass it explicitly for Slack-compatible endpoints elsewhere.
    Pass a shared session to reuse connections across deliveries; the deadline cuts only connections it
    watches, so mount a ``DeadlineAdapter`` on it (``egress.public_session`` has one).
    """
    if not deadline > 0:
        raise ValueError("deadline must be > 0 seconds")
    safe_url = redact_url(url)
    if slack is None:
        try:
            slack = (urlsplit(url).hostname or "").lower() == "hooks.slack.com"
        except ValueError:
            slack = False
    send_headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT}
    send_headers.update(headers or {})
    own_session = session is None
    http = _watched_session() if session is None else session
    started = time.monotonic()
    try:
        with within(deadline) as watch:
            outcome = _exchange(http, url, body, send_headers, timeout, slack=slack, started=started)
            if watch.cut():
                # Whatever the cut made of it (a connection error, a short body), the receiver ran out of time.
                outcome = Outcome(Verdict.RETRY, None, "timeout", elapsed_s=time.monotonic() - started)
    finally:
        if own_session:
            http.close()
    log = logger.info if outcome.delivered else logger.warning
    log(
        "webhook POST %s -> %s status=%s error=%s retry_after=%s (%.2fs)",
        safe_url,
        outcome.verdict,
        outcome.status,
        outcome.error or "-",
        outcome.retry_after,
        outcome.elapsed_s,
    )
    return outcome


def _exchange(http: requests.Session, url: str, body: bytes, send_headers: Mapping[str, str],
              timeout: float | tuple[float, float], *, slack: bool, started: float) -> Outcome:
    try:
        response = http.post(url, data=body, headers=send_headers, timeout=timeout, allow_redirects=False, stream=True)
    except requests.Timeout:
        # A read timeout may mean the receiver did act on it; retrying is still right
        # (webhook-id lets a tenant de-duplicate; Slack rarely times out after posting).
        return Outcome(Verdict.RETRY, None, "timeout", elapsed_s=time.monotonic() - started)
    except requests.exceptions.SSLError:
        return Outcome(Verdict.RETRY, None, "tls_error", elapsed_s=time.monotonic() - started)
    except requests.ConnectionError as exc:
        blocked = private_destination_of(exc)
        if blocked:  # the name led somewhere private by the time it was called (egress.public_session)
            return Outcome(Verdict.PERMANENT, None, f"blocked_destination: {blocked}",
                           elapsed_s=time.monotonic() - started)
        return Outcome(Verdict.RETRY, None, "connection_error", elapsed_s=time.monotonic() - started)
    except (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema):
        return Outcome(Verdict.PERMANENT, None, "invalid_url", elapsed_s=time.monotonic() - started)
    except requests.RequestException as exc:
        # str(exc) from requests embeds the full URL, so only the type name is recorded.
        return Outcome(
            Verdict.RETRY, None, f"request_error:{type(exc).__name__}", elapsed_s=time.monotonic() - started
        )
    with response:
        try:
            text = _read_body(response)
        except requests.RequestException:
            # The status line arrived but the body did not: classify on the status alone.
            text = ""
        outcome = classify(response.status_code, text, response.headers, slack=slack)
    return dataclasses.replace(outcome, elapsed_s=time.monotonic() - started)
