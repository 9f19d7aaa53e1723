"""Strict serializer fields: the API rejects what it cannot take literally."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from django.utils.dateparse import parse_datetime
from rest_framework import serializers

from .statements import CompiledLookup, marker_user
from .timefmt import format_utc

__all__ = [
    "DATETIME_MAX", "DATETIME_MIN", "AwareDateTimeField", "in_supported_range", "StrictBooleanField",
    "StrictIntegerField", "StrictSlugRelatedField", "ScopedSlugRelatedField", "StrictCharField", "StrictRegexField",
]


# The datetimes the portal takes: wide enough for any booking, listing or feed, and far enough from
# Python's year 1 and 9999 that no offset, default window or horizon added to them can overflow.
DATETIME_MIN = datetime(1970, 1, 1, tzinfo=UTC)
DATETIME_MAX = datetime(9000, 1, 1, tzinfo=UTC)
RANGE_MESSAGE = "Must be a date between 1970 and 8999 (UTC)."


def in_supported_range(value: datetime) -> datetime | None:
    """value in UTC when it lies in [DATETIME_MIN, DATETIME_MAX), else None (also when converting it to
    UTC would leave Python's calendar, as 0001-01-01T00:00+14:00 does)."""
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        return None
    return utc if DATETIME_MIN <= utc < DATETIME_MAX else None


class AwareDateTimeField(serializers.DateTimeField):
    """ISO 8601 with an explicit UTC offset in; UTC with Z out. Naive input is an error, not a guess."""

    default_error_messages = {
        "naive": "Give the datetime with a UTC offset (e.g. 2026-01-05T09:00:00Z).",
        "invalid": "Not an ISO 8601 datetime.",
        "plus_as_space": ("Not an ISO 8601 datetime: its UTC offset's \"+\" arrived as a space, as an unencoded "
                          "\"+\" in a query string does. Write it %2B (…T09:00:00%2B02:00), or give the time in UTC "
                          "with Z."),
        "range": RANGE_MESSAGE,
    }
    # What "…T09:00:00+02:00" reads as after a query string has turned its "+" into a space. Not taken for a
    # "+" (DESIGN §6: ISO 8601 with an offset, one spelling); named, so the 400 says what to do.
    PLUS_AS_SPACE = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)? \d{2}(?::?\d{2})?")

    @classmethod
    def parse(cls, value) -> tuple[datetime | None, str | None]:
        """(the value in UTC, None) for a value this field takes, else (None, the key of its error message)."""
        # Python's ISO parser lets a trailing NUL through ("…00Z\x00"): control characters are
        # refused outright, not parsed around.
        if not isinstance(value, str) or any(ord(c) < 32 for c in value):
            return None, "invalid"
        try:
            parsed = parse_datetime(value.strip())
        except ValueError:
            parsed = None
        if parsed is None:
            return None, "plus_as_space" if cls.PLUS_AS_SPACE.fullmatch(value.strip()) else "invalid"
        if parsed.tzinfo is None or parsed.utcoffset() is None:
            return None, "naive"
        utc = in_supported_range(parsed)
        return (utc, None) if utc is not None else (None, "range")

    def to_internal_value(self, value):
        utc, error = self.parse(value)
        if error:
            self.fail(error)
        return utc

    def to_representation(self, value):
        if value is None:
            return None
        return format_utc(value)


class StrictIntegerField(serializers.IntegerField):
    """Whole JSON numbers only: no booleans, floats or numeric strings."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class _StringOnly:
    """A JSON string only: DRF's CharField takes a number and stores its text (a node named "5", a password
    12345678901234), where the API takes each value as the JSON type its field is."""

    default_error_messages = {"not_a_string": "Not a valid string."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("not_a_string")
        return super().to_internal_value(data)


class StrictCharField(_StringOnly, serializers.CharField):
    """DRF's CharField, refusing anything but a JSON string."""


class StrictRegexField(_StringOnly, serializers.RegexField):
    """DRF's RegexField, refusing anything but a JSON string."""


class StrictBooleanField(serializers.BooleanField):
    """JSON true or false only: not DRF's loose "yes", "on", "1", 1 or "false" (a string a script meant
    as false)."""

    default_error_messages = {"invalid": "Must be true or false (a JSON boolean)."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictSlugRelatedField(serializers.SlugRelatedField):
    """A slug lookup that takes only a string without NUL (PostgreSQL text cannot hold one): anything
    else is a 400 naming the field, never a database error. An unknown slug reads "Unknown pool 'zzz'."
    (noun: the field's name unless given), as every endpoint words it, not DRF's "Object with name=zzz
    does not exist."."""

    default_error_messages = {
        "invalid": "Invalid value.",
        "nul": "Must not contain NUL characters.",
        "does_not_exist": "Unknown {slug_name} {value}.",
    }

    def __init__(self, *, noun: str = "", **kwargs):
        self.noun = noun
        super().__init__(**kwargs)

    def check_slug(self, data) -> None:
        if not isinstance(data, str):
            self.fail("invalid")
        if "\x00" in data:
            self.fail("nul")

    def fail_unknown(self, data) -> None:
        self.fail("does_not_exist", slug_name=self.noun or (self.field_name or self.slug_field).replace("_", " "),
                  value=repr(data)[:60])

    def to_internal_value(self, data):
        self.check_slug(data)
        obj = self.get_queryset().filter(**{self.slug_field: data}).first()
        if obj is None:
            self.fail_unknown(data)
        return obj


class ScopedSlugRelatedField(StrictSlugRelatedField):
    """A slug lookup inside the requesting user's scope; a foreign object reads as unknown.

    `scope(user)` returns the queryset the user may pick from (the tenant scope, usually); the
    lookup runs as a `CompiledLookup`, so the request binds the user and slug into SQL the ORM
    compiled from that scope once per thread and shape (staff, member, anonymous). A scope may
    branch on `is_authenticated` and `is_staff` only (they make the shape; it is handed a stand-in
    user with nothing else of the real one); anything else must reach the SQL as a bound value,
    as the user's id does.
    """

    lookup = CompiledLookup(int, str)

    def __init__(self, *, scope, per_user: bool = True, **kwargs):
        """per_user=False: the scope is the same for every user (pools); otherwise a member's scope
        must bind the user's id into its SQL, or the lookup refuses to compile."""
        self.scope = scope
        self.per_user = per_user
        super().__init__(**kwargs)

    def get_queryset(self):
        request = self.context.get("request")
        return self.scope(getattr(request, "user", None))

    def to_internal_value(self, data):
        self.check_slug(data)
        obj = self.find(getattr(self.context.get("request"), "user", None), data)
        if obj is None:
            self.fail_unknown(data)
        return obj

    def find(self, user, data: str):
        """The object named data (a str without NUL, as check_slug leaves it) in user's scope, or None. Reads
        nothing of the field's context: a fast path may call it on the serializer's declared field."""
        authenticated = bool(getattr(user, "is_authenticated", False))
        staff = authenticated and bool(getattr(user, "is_staff", False))

        def build(pk, slug):
            return self.scope(marker_user(user, pk)).filter(**{self.slug_field: slug})

        # A member's scope must bind the user's id; staff scopes may not filter by it at all.
        optional = (0,) if staff or not authenticated or not self.per_user else ()
        return self.lookup.get(build, user.pk if authenticated else 0, data,
                               shape=(self.scope, self.slug_field, authenticated, staff), optional=optional)
