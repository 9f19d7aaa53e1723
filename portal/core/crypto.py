"""Secrets at rest: MultiFernet over PORTAL_FERNET_KEYS (first key encrypts, every key decrypts)."""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models

__all__ = ["encrypt", "decrypt", "rotate", "EncryptedTextField", "InvalidToken", "mask"]


def _fernet() -> MultiFernet:
    keys = [k for k in getattr(settings, "PORTAL_FERNET_KEYS", []) if k]
    if not keys:
        raise ImproperlyConfigured("PORTAL_FERNET_KEYS is empty: secrets cannot be stored.")
    return MultiFernet([Fernet(k.encode() if isinstance(k, str) else k) for k in keys])


def encrypt(plaintext: str) -> str:
    return _fernet().encrypt(plaintext.encode()).decode()


def decrypt(token: str) -> str:
    return _fernet().decrypt(token.encode()).decode()


def rotate(token: str) -> str:
    """Re-encrypt token under the newest key (after a key was prepended to PORTAL_FERNET_KEYS)."""
    return _fernet().rotate(token.encode()).decode()


def mask(secret: str, keep: int = 4) -> str:
    """Show a secret only by its last few characters, e.g. for a webhook URL in a form."""
    if not secret:
        return ""
    return "•" * 8 + secret[-keep:]


class EncryptedTextField(models.TextField):
    """A text column holding Fernet ciphertext; Python sees the plaintext. Empty stays empty."""

    def from_db_value(self, value, expression, connection):
        if not value:
            return value
        return decrypt(value)

    def get_prep_value(self, value):
        value = super().get_prep_value(value)
        if not value:
            return value
        return encrypt(value)
