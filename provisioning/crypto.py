"""Secrets at rest: MultiFernet over PORTAL_FERNET_KEYS, and SSH key pairs made with cryptography.

PORTAL_FERNET_KEYS is a list of Fernet keys (url-safe base64 of 32 bytes), newest first.
New secrets are encrypted with the first key; any key in the list decrypts, so rotating is:
put a new key first, run ``manage.py rotate_credentials`` (re-encrypts every stored secret
with the new key), then drop the old key.
"""

from __future__ import annotations

import base64
import functools
import hashlib

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

__all__ = ["SecretUnreadable", "encrypt", "decrypt", "rotate", "ssh_keypair", "SshKeyPair"]


class SecretUnreadable(Exception):
    """No configured key decrypts this token (its key was removed too early)."""


@functools.lru_cache(maxsize=8)
def _multifernet(keys: tuple[str, ...]) -> MultiFernet:
    if not keys:
        raise ImproperlyConfigured("PORTAL_FERNET_KEYS is empty: credentials cannot be encrypted.")
    try:
        return MultiFernet([Fernet(key) for key in keys])
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"PORTAL_FERNET_KEYS holds an invalid Fernet key: {exc}") from None


def _fernet() -> MultiFernet:
    return _multifernet(tuple(settings.PORTAL_FERNET_KEYS))


def encrypt(plaintext: str | bytes) -> str:
    """Encrypt with the primary (first) key; return the token as text."""
    data = plaintext.encode() if isinstance(plaintext, str) else plaintext
    return _fernet().encrypt(data).decode()


def decrypt(token: str) -> bytes:
    """Decrypt with whichever configured key made the token."""
    try:
        return _fernet().decrypt(token.encode())
    except InvalidToken:
        raise SecretUnreadable("no key in PORTAL_FERNET_KEYS decrypts this secret") from None


def rotate(token: str) -> str:
    """Re-encrypt a token with the primary key (readable by any configured key)."""
    try:
        return _fernet().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("no key in PORTAL_FERNET_KEYS decrypts this secret") from None


class SshKeyPair:
    """An Ed25519 key pair in OpenSSH formats. repr() never shows the private key."""

    __slots__ = ("private_openssh", "public_openssh", "fingerprint")

    def __init__(self, private_openssh: str, public_openssh: str, fingerprint: str) -> None:
        self.private_openssh = private_openssh
        self.public_openssh = public_openssh
        self.fingerprint = fingerprint

    def __repr__(self) -> str:
        return f"SshKeyPair({self.fingerprint})"


def ssh_keypair(comment: str) -> SshKeyPair:
    """Make a new Ed25519 key pair; the fingerprint is OpenSSH's SHA256:… form."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    blob = base64.b64decode(public.split()[1])
    fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return SshKeyPair(private, f"{public} {comment}".strip(), fingerprint)
