"""Sign and verify outgoing webhooks the Standard Webhooks way.

https://www.standardwebhooks.com/ (spec/standard-webhooks.md): every request carries

    webhook-id:        msg_<random>         unique per message, the same on every retry
    webhook-timestamp: <unix seconds>       fresh on every attempt
    webhook-signature: v1,<base64 sig> ...  space-separated, one per active secret

where ``sig = HMAC-SHA256(key, f"{id}.{timestamp}.".encode() + body)`` and the secret is
``whsec_`` + base64(key). We follow the format exactly rather than inventing our own so a
tenant can verify our requests with any off-the-shelf Standard Webhooks / Svix library.

Key rotation: sign with the old and the new secret at once (two ``v1,`` entries) until the
tenant has switched their receiver to the new secret, then drop the old one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as _secrets
import time
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "SECRET_PREFIX",
    "DEFAULT_TOLERANCE_S",
    "SignatureError",
    "generate_secret",
    "decode_secret",
    "generate_message_id",
    "sign",
    "sign_headers",
    "verify",
]

SECRET_PREFIX = "whsec_"
# The spec asks for keys between 24 and 64 bytes; 32 is what the reference libraries generate.
MIN_SECRET_BYTES = 24
MAX_SECRET_BYTES = 64
DEFAULT_SECRET_BYTES = 32
# Five minutes either way, as in the reference implementations and Stripe: wide enough for
# clock skew, narrow enough that a captured request cannot be replayed much later.
DEFAULT_TOLERANCE_S = 300
SIGNATURE_VERSION = "v1"

HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"


class SignatureError(ValueError):
    """Raised when a webhook request fails verification; the message says why."""


def generate_secret(nbytes: int = DEFAULT_SECRET_BYTES) -> str:
    """Return a new random signing secret as ``whsec_<base64>``."""
    if not MIN_SECRET_BYTES <= nbytes <= MAX_SECRET_BYTES:
        raise ValueError(f"secret length must be {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes, got {nbytes}")
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(nbytes)).decode("ascii")


def decode_secret(secret: str) -> bytes:
    """Return the raw HMAC key of a ``whsec_<base64>`` secret (the prefix is optional).

    Raise ValueError for anything that is not base64 of 24-64 bytes, so a truncated or
    mistyped secret fails loudly instead of signing with a weak key.
    """
    encoded = secret.removeprefix(SECRET_PREFIX).strip()
    try:
        # validate=True: reject stray characters instead of silently skipping them.
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("webhook secret is not valid base64") from exc
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise ValueError(f"webhook secret must decode to {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes")
    return key


def generate_message_id() -> str:
    """Return a new unique message id; reuse it on every retry of the same message."""
    return "msg_" + _secrets.token_urlsafe(18)


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode("utf-8") if isinstance(body, str) else body


def _digest(key: bytes, msg_id: str, timestamp: int, body: bytes) -> bytes:
    # Concatenate bytes, not str: the body is signed exactly as it goes on the wire.
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return hmac.new(key, signed, hashlib.sha256).digest()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes | str) -> str:
    """Return one ``v1,<base64>`` signature of body for msg_id at timestamp (unix seconds)."""
    if "." in msg_id or not msg_id:
        # The id is dot-delimited in the signed content; a dot in it would be ambiguous.
        raise ValueError("msg_id must be non-empty and contain no '.'")
    mac = _digest(decode_secret(secret), msg_id, int(timestamp), _as_bytes(body))
    return f"{SIGNATURE_VERSION},{base64.b64encode(mac).decode('ascii')}"


def _secret_list(secrets: str | Sequence[str]) -> list[str]:
    found = [secrets] if isinstance(secrets, str) else list(secrets)
    if not found:
        raise ValueError("at least one webhook secret is required")
    return found


def sign_headers(
    secrets: str | Sequence[str],
    body: bytes | str,
    *,
    msg_id: str | None = None,
    timestamp: int | None = None,
) -> dict[str, str]:
    """Return the three Standard Webhooks headers for body.

    Pass several secrets during key rotation: the signature header then carries one
    space-separated signature per secret, and a receiver holding either secret accepts it.
    Pass the message's original msg_id on a retry; timestamp defaults to now.
    """
    msg_id = msg_id or generate_message_id()
    ts = int(time.time()) if timestamp is None else int(timestamp)
    signatures = " ".join(sign(s, msg_id, ts, body) for s in _secret_list(secrets))
    return {HEADER_ID: msg_id, HEADER_TIMESTAMP: str(ts), HEADER_SIGNATURE: signatures}


def _header(headers: Mapping[str, str], name: str) -> str:
    # HTTP header names are case-insensitive; frameworks hand them over in any case.
    for key, value in headers.items():
        if key.lower() == name:
            return value
    raise SignatureError(f"missing {name} header")


def _candidate_signatures(header: str) -> Iterable[bytes]:
    for entry in header.split():
        version, sep, encoded = entry.partition(",")
        if not sep or version != SIGNATURE_VERSION:
            continue  # other versions (e.g. v1a, asymmetric) are not ours to check
        try:
            yield base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            continue  # one malformed entry must not hide a valid one next to it


def verify(
    secrets: str | Sequence[str],
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    tolerance_s: int = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> str:
    """Check a received webhook's signature and timestamp; return its webhook-id.

    Accept if any ``v1`` signature in the header matches any of secrets (rotation works
    from both ends), and the timestamp is within tolerance_s of now. Raise SignatureError
    otherwise. The caller should use the returned id to drop duplicate deliveries.
    """
    msg_id = _header(headers, HEADER_ID)
    raw_ts = _header(headers, HEADER_TIMESTAMP).strip()
    signature_header = _header(headers, HEADER_SIGNATURE)

    if not raw_ts.isascii() or not raw_ts.isdigit():
        raise SignatureError("webhook-timestamp is not an integer unix timestamp")
    timestamp = int(raw_ts)
    current = time.time() if now is None else now
    if timestamp < current - tolerance_s:
        raise SignatureError("webhook-timestamp is too old")
    if timestamp > current + tolerance_s:
        raise SignatureError("webhook-timestamp is too far in the future")

    payload = _as_bytes(body)
    expected = [_digest(decode_secret(s), msg_id, timestamp, payload) for s in _secret_list(secrets)]
    matched = False
    for candidate in _candidate_signatures(signature_header):
        for mac in expected:
            # compare_digest: constant time, so response timing leaks nothing about the MAC.
            # Keep looping after a match for the same reason.
            matched |= hmac.compare_digest(mac, candidate)
    if not matched:
        raise SignatureError("no matching signature")
    return msg_id
