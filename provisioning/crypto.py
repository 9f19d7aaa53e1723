"""Cluster credentials: SSH key pairs made with cryptography, encrypted at rest by portal.core.crypto.

Rotating the encryption key: put a new key first in PORTAL_FERNET_KEYS, run
``manage.py rotate_credentials`` (re-encrypts every stored secret), then drop the old key.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from portal.core.crypto import SecretUnreadable, encrypt, rotate
from portal.core.crypto import decrypt_bytes as decrypt

__all__ = ["SecretUnreadable", "encrypt", "decrypt", "rotate", "ssh_keypair", "SshKeyPair"]


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
