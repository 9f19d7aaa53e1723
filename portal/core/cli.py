"""Helpers for management commands."""

from __future__ import annotations

from django.core.management.base import CommandError

__all__ = ["storable_text"]


def storable_text(value: str | None, *, what: str) -> str | None:
    """Return value if PostgreSQL text can hold it, else raise a CommandError naming the argument.

    PostgreSQL text cannot hold NUL, and a byte that is not UTF-8 in argv reaches Python as a lone
    surrogate (os.fsdecode) that psycopg cannot encode: either was a traceback out of the database
    driver instead of the one-line message (and exit status 1) every other bad argument gets.
    """
    if value is None:
        return None
    if "\x00" in value:
        raise CommandError(f"{what}: must not contain NUL (\\x00) characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise CommandError(f"{what}: {value!r} is not valid UTF-8 (check the terminal's encoding).") from None
    return value
