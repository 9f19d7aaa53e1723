"""Secrets at rest: MultiFernet over PORTAL_FERNET_KEYS (first key encrypts, every key decrypts).

PORTAL_FERNET_KEYS is a list of Fernet keys (url-safe base64 of 32 bytes), newest first.
Rotating is: put a new key first, re-encrypt the stored secrets (``manage.py
rotate_credentials``), then drop the old key.
"""

from __future__ import annotations

import functools
import logging

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models

__all__ = [
    "encrypt", "decrypt", "decrypt_bytes", "rotate", "mask", "EncryptedTextField", "InvalidToken", "SecretUnreadable",
    "rotate_encrypted_columns",
]

logger = logging.getLogger(__name__)


class SecretUnreadable(InvalidToken):
    """No configured key decrypts this token (its key was removed too early)."""


@functools.lru_cache(maxsize=8)
def _multifernet(keys: tuple[str, ...]) -> MultiFernet:
    if not keys:
        raise ImproperlyConfigured("PORTAL_FERNET_KEYS is empty: secrets cannot be stored.")
    try:
        return MultiFernet([Fernet(key) for key in keys])
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"PORTAL_FERNET_KEYS holds an invalid Fernet key: {exc}") from None


def _fernet() -> MultiFernet:
    return _multifernet(tuple(k for k in getattr(settings, "PORTAL_FERNET_KEYS", []) if k))


def encrypt(plaintext: str | bytes) -> str:
    """Encrypt with the primary (first) key; return the token as text."""
    data = plaintext.encode() if isinstance(plaintext, str) else plaintext
    return _fernet().encrypt(data).decode()


def decrypt_bytes(token: str) -> bytes:
    """Decrypt with whichever configured key made the token."""
    try:
        return _fernet().decrypt(token.encode())
    except InvalidToken:
        raise SecretUnreadable("no key in PORTAL_FERNET_KEYS decrypts this secret") from None


def decrypt(token: str) -> str:
    return decrypt_bytes(token).decode()


def rotate(token: str) -> str:
    """Re-encrypt a token with the primary key (after a key was prepended to PORTAL_FERNET_KEYS)."""
    try:
        return _fernet().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("no key in PORTAL_FERNET_KEYS decrypts this secret") from None


def mask(secret: str, keep: int = 4) -> str:
    """Show a secret only by its last few characters, e.g. for a webhook URL in a form."""
    if not secret:
        return ""
    return "•" * 8 + secret[-keep:]


class UnreadableSecret(str):
    """What an EncryptedTextField holds when no configured key decrypts its column: an empty string to
    whoever reads it (a Slack URL that is "not set"), while saving the row writes the ciphertext back
    unchanged. One secret whose key was dropped too early (or a rotation stopped halfway) must not make
    every load of its row fail — the tenant's pages, feed and bookings — nor be destroyed by a save."""

    ciphertext: str

    def __new__(cls, ciphertext: str) -> UnreadableSecret:
        obj = super().__new__(cls, "")
        obj.ciphertext = ciphertext
        return obj


class EncryptedTextField(models.TextField):
    """A text column holding Fernet ciphertext; Python sees the plaintext. Empty stays empty."""

    def from_db_value(self, value, expression, connection):
        if not value:
            return value
        try:
            return decrypt(value)
        except SecretUnreadable:
            logger.error("%s.%s of a row cannot be decrypted with PORTAL_FERNET_KEYS; it reads as empty and is kept "
                         "as stored (put the key it was written with back in the list)", self.model.__name__,
                         self.name)
            return UnreadableSecret(value)

    def get_prep_value(self, value):
        if isinstance(value, UnreadableSecret):
            return value.ciphertext
        value = super().get_prep_value(value)
        if not value:
            return value
        return encrypt(value)


def rotate_encrypted_columns() -> tuple[int, int]:
    """Re-encrypt every EncryptedTextField value of every model with the primary key.

    Works on the stored ciphertext with raw SQL (the field would hand Python the plaintext),
    one table at a time, each in its own transaction. Return (re-encrypted, unreadable): a value no
    configured key decrypts is left as stored (logged by table and row), and the others are still rotated.
    """
    from django.apps import apps
    from django.db import connection, transaction

    count = unreadable = 0
    for model in apps.get_models():
        for field in model._meta.concrete_fields:
            if not isinstance(field, EncryptedTextField):
                continue
            table, column, pk = model._meta.db_table, field.column, model._meta.pk.column
            qn = connection.ops.quote_name
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(f"SELECT {qn(pk)}, {qn(column)} FROM {qn(table)} WHERE {qn(column)} <> '' FOR UPDATE")  # noqa: S608
                rows = []
                for key, value in cur.fetchall():
                    try:
                        rows.append((rotate(value), key))
                    except SecretUnreadable:
                        unreadable += 1
                        logger.error("%s.%s of row %s cannot be decrypted with PORTAL_FERNET_KEYS; left as stored",
                                     table, column, key)
                cur.executemany(f"UPDATE {qn(table)} SET {qn(column)} = %s WHERE {qn(pk)} = %s", rows)  # noqa: S608
            count += len(rows)
    return count, unreadable
