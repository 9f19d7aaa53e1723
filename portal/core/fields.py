"""Strict serializer fields: the API rejects what it cannot take literally."""

from __future__ import annotations

from datetime import UTC

from django.utils.dateparse import parse_datetime
from rest_framework import serializers

from .statements import CompiledLookup, marker_user

__all__ = ["AwareDateTimeField", "StrictIntegerField", "ScopedSlugRelatedField"]


class AwareDateTimeField(serializers.DateTimeField):
    """ISO 8601 with an explicit UTC offset in; UTC with Z out. Naive input is an error, not a guess."""

    default_error_messages = {
        "naive": "Give the datetime with a UTC offset (e.g. 2026-01-05T09:00:00Z).",
        "invalid": "Not an ISO 8601 datetime.",
    }

    def to_internal_value(self, value):
        if not isinstance(value, str):
            self.fail("invalid")
        try:
            parsed = parse_datetime(value.strip())
        except ValueError:
            parsed = None
        if parsed is None:
            self.fail("invalid")
        if parsed.tzinfo is None or parsed.utcoffset() is None:
            self.fail("naive")
        return parsed.astimezone(UTC)

    def to_representation(self, value):
        if value is None:
            return None
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StrictIntegerField(serializers.IntegerField):
    """Whole JSON numbers only: no booleans, floats or numeric strings."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class ScopedSlugRelatedField(serializers.SlugRelatedField):
    """A slug lookup inside the requesting user's scope; a foreign object reads as unknown.

    `scope(user)` returns the queryset the user may pick from (the tenant scope, usually); the
    lookup runs as a `CompiledLookup`, so the request binds the user and slug into SQL the ORM
    compiled from that scope once per thread and shape (staff, member, anonymous). A scope may
    branch on `is_authenticated` and `is_staff` only (they make the shape); anything else it
    reads of the user must reach the SQL as a bound value, as the user's id does.
    """

    default_error_messages = {
        "does_not_exist": "Unknown {slug_name} {value}.",
        "invalid": "Invalid value.",
    }
    lookup = CompiledLookup(int, str, optional=(0,))

    def __init__(self, *, scope, noun: str = "", **kwargs):
        self.scope = scope
        self.noun = noun
        super().__init__(**kwargs)

    def get_queryset(self):
        request = self.context.get("request")
        return self.scope(getattr(request, "user", None))

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        user = getattr(self.context.get("request"), "user", None)
        authenticated = bool(getattr(user, "is_authenticated", False))
        staff = bool(getattr(user, "is_staff", False))
        user_pk = user.pk if authenticated else 0

        def build(pk, slug):
            return self.scope(marker_user(user, pk) if user is not None else None).filter(**{self.slug_field: slug})

        shape = (self.scope, self.slug_field, user is not None, authenticated, staff)
        obj = self.lookup.get(build, user_pk, data, shape=shape)
        if obj is None:
            self.fail("does_not_exist", slug_name=self.noun or self.slug_field.replace("_", " "),
                      value=repr(data)[:60])
        return obj
