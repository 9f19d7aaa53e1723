"""Standard Webhooks signing, checked against the published test vector and the
independent reference library (``standardwebhooks`` from PyPI) in both directions."""

from __future__ import annotations

import base64
import hmac
import json
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from notifications import signing
from notifications.signing import SignatureError, decode_secret, generate_secret, sign, sign_headers, verify

# The Standard Webhooks / Svix reference test vector (also in their libraries' test suites).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

BODY = json.dumps({"type": "reservation.confirmed", "data": {"id": 42, "name": "llm – ünïcode"}}).encode()


def test_reproduces_the_published_test_vector() -> None:
    assert sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIGNATURE
    # ... and accepts it, as a receiver would at the moment it was sent.
    headers = {"webhook-id": VECTOR_ID, "webhook-timestamp": str(VECTOR_TS), "webhook-signature": VECTOR_SIGNATURE}
    assert verify(VECTOR_SECRET, VECTOR_BODY, headers, now=VECTOR_TS + 10) == VECTOR_ID


def test_the_reference_library_agrees_with_the_vector_too() -> None:
    # Guards the test itself: the vector and the library we compare with are consistent.
    when = datetime.fromtimestamp(VECTOR_TS, tz=UTC)
    assert Webhook(VECTOR_SECRET).sign(VECTOR_ID, when, VECTOR_BODY.decode()) == VECTOR_SIGNATURE


def test_the_reference_library_verifies_what_we_sign() -> None:
    secret = generate_secret()
    headers = sign_headers(secret, BODY)
    assert Webhook(secret).verify(BODY, headers) == json.loads(BODY)


def test_we_verify_what_the_reference_library_signs() -> None:
    secret = generate_secret()
    now = int(time.time())
    signature = Webhook(secret).sign("msg_ref", datetime.fromtimestamp(now, tz=UTC), BODY.decode())
    headers = {"Webhook-Id": "msg_ref", "Webhook-Timestamp": str(now), "Webhook-Signature": signature}
    assert verify(secret, BODY, headers) == "msg_ref"  # header names in any case


def test_headers_have_the_standard_shape() -> None:
    headers = sign_headers(generate_secret(), BODY, msg_id="msg_fixed", timestamp=1_700_000_000)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert headers["webhook-id"] == "msg_fixed"
    assert headers["webhook-timestamp"] == "1700000000"
    version, sig = headers["webhook-signature"].split(",")
    assert version == "v1" and len(base64.b64decode(sig)) == 32  # a SHA-256 MAC


def test_generated_secrets_and_ids() -> None:
    secrets = {generate_secret() for _ in range(20)}
    assert len(secrets) == 20
    for secret in secrets:
        assert secret.startswith("whsec_")
        assert len(decode_secret(secret)) == 32
    assert len(decode_secret(generate_secret(64))) == 64
    for bad in (23, 65):
        with pytest.raises(ValueError):
            generate_secret(bad)
    ids = {signing.generate_message_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("msg_") and "." not in i for i in ids)


def test_decode_secret() -> None:
    raw = bytes(range(24))
    encoded = base64.b64encode(raw).decode()
    assert decode_secret("whsec_" + encoded) == raw
    assert decode_secret(encoded) == raw  # the prefix is optional, as in the reference libraries
    for bad in ("whsec_not*base64", "whsec_" + base64.b64encode(b"short").decode(), "whsec_", ""):
        with pytest.raises(ValueError):
            decode_secret(bad)


def test_tampered_body_is_rejected_by_both_implementations() -> None:
    secret = generate_secret()
    headers = sign_headers(secret, BODY)
    tampered = BODY.replace(b"42", b"43")
    with pytest.raises(SignatureError, match="no matching signature"):
        verify(secret, tampered, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(tampered, headers)


def test_tampered_id_or_timestamp_is_rejected() -> None:
    secret = generate_secret()
    headers = sign_headers(secret, BODY)
    with pytest.raises(SignatureError):
        verify(secret, BODY, {**headers, "webhook-id": "msg_other"})
    shifted = str(int(headers["webhook-timestamp"]) - 1)
    with pytest.raises(SignatureError):
        verify(secret, BODY, {**headers, "webhook-timestamp": shifted})


def test_wrong_secret_is_rejected() -> None:
    headers = sign_headers(generate_secret(), BODY)
    with pytest.raises(SignatureError):
        verify(generate_secret(), BODY, headers)


def test_stale_and_future_timestamps_are_rejected() -> None:
    secret = generate_secret()
    now = time.time()
    stale = sign_headers(secret, BODY, timestamp=int(now) - 301)
    with pytest.raises(SignatureError, match="too old"):
        verify(secret, BODY, stale, now=now)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY, stale)  # the reference agrees: 5 minutes is the limit

    future = sign_headers(secret, BODY, timestamp=int(now) + 301)
    with pytest.raises(SignatureError, match="future"):
        verify(secret, BODY, future, now=now)

    recent = sign_headers(secret, BODY, timestamp=int(now) - 290)
    assert verify(secret, BODY, recent, now=now) == recent["webhook-id"]
    with pytest.raises(SignatureError, match="too old"):
        verify(secret, BODY, recent, now=now, tolerance_s=60)


@pytest.mark.parametrize("timestamp", ["", "abc", "1.5e9", "-5", "１７００"])
def test_malformed_timestamps_are_rejected(timestamp: str) -> None:
    secret = generate_secret()
    headers = {**sign_headers(secret, BODY), "webhook-timestamp": timestamp}
    with pytest.raises(SignatureError):
        verify(secret, BODY, headers)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_headers_are_rejected(missing: str) -> None:
    secret = generate_secret()
    headers = sign_headers(secret, BODY)
    del headers[missing]
    with pytest.raises(SignatureError, match=missing):
        verify(secret, BODY, headers)


def test_key_rotation_with_two_signatures() -> None:
    old, new, unrelated = generate_secret(), generate_secret(), generate_secret()
    headers = sign_headers([old, new], BODY)
    entries = headers["webhook-signature"].split(" ")
    assert len(entries) == 2 and all(e.startswith("v1,") for e in entries)

    # A receiver still on the old secret and one already on the new both accept.
    for secret in (old, new):
        assert verify(secret, BODY, headers) == headers["webhook-id"]
        assert Webhook(secret).verify(BODY, headers) == json.loads(BODY)
    # A receiver holding both (rotating on its side) accepts a message signed with one.
    assert verify([unrelated, new], BODY, sign_headers(new, BODY))
    with pytest.raises(SignatureError):
        verify(unrelated, BODY, headers)


def test_unknown_versions_and_garbage_entries_do_not_hide_a_good_signature() -> None:
    secret = generate_secret()
    headers = sign_headers(secret, BODY)
    headers["webhook-signature"] = "v1a,c29tZXRoaW5n v1,###not-base64### junk " + headers["webhook-signature"]
    assert verify(secret, BODY, headers) == headers["webhook-id"]


def test_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(signing.hmac, "compare_digest", spy)
    secret = generate_secret()
    verify(secret, BODY, sign_headers(secret, BODY))
    assert calls, "signatures must be compared with hmac.compare_digest"


def test_str_and_bytes_bodies_sign_the_same() -> None:
    secret = generate_secret()
    text = BODY.decode()
    assert sign(secret, "msg_1", 1, text) == sign(secret, "msg_1", 1, BODY)


def test_message_ids_with_dots_are_refused() -> None:
    with pytest.raises(ValueError):
        sign(generate_secret(), "msg.1", 1, BODY)
