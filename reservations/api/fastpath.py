"""A booking's body read without DRF's field machinery (issue #2: booking throughput).

`ReservationCreateSerializer` costs more CPU than anything else in a booking's request but the booking
itself: deep-copying its fields and running their validation chains. `booking_body` reads a plainly valid
body directly and returns exactly what the serializer's validated_data would be; anything else (an unknown
or missing key, a value of another JSON type, an odd string, a value out of range, an unknown tenant or
pool, no tenant named) gives None, and the view runs the serializer as before, so every refusal is worded
as it always was. It never accepts what the serializer refuses (tests/test_booking_fastpath.py).

Limits, defaults and choices are read from the serializer's declared fields, and the tenant and pool are
looked up by those fields' own compiled lookups, so the two cannot drift apart.
"""

from __future__ import annotations

import re
from typing import Any

from portal.core.fields import AwareDateTimeField

from .serializers import ClusterSpecSerializer, ReservationCreateSerializer

_FIELDS = ReservationCreateSerializer._declared_fields
_CLUSTER_FIELDS = ClusterSpecSerializer._declared_fields
# The keys read here; a field added to the serializer must be added here too (a test checks they agree).
HANDLED = ("tenant", "pool", "node_count", "start", "end", "name", "cluster")
_REQUIRED = frozenset({"tenant", "pool", "node_count", "start", "end"})
_KNOWN = frozenset(HANDLED)
_COUNT, _NAME = _FIELDS["node_count"], _FIELDS["name"]
# What a name may not hold after trimming (DRF refuses NUL and lone surrogates; other control characters are
# left to the serializer rather than judged here).
_ODD_IN_NAME = re.compile(r"[\x00-\x1f\ud800-\udfff]")


def _aware(value: Any):
    """AwareDateTimeField's value (UTC) for a value it takes, else None."""
    return AwareDateTimeField.parse(value)[0]


def _cluster(spec: Any) -> dict | None:
    """ClusterSpecSerializer's value for a spec of known keys with string choices, else None."""
    if type(spec) is not dict or not spec.keys() <= _CLUSTER_FIELDS.keys():
        return None
    out = {}
    for key, field in _CLUSTER_FIELDS.items():
        if key not in spec:
            out[key] = field.default
        elif type(spec[key]) is str and spec[key] in field.choice_strings_to_values:
            out[key] = field.choice_strings_to_values[spec[key]]
        else:
            return None
    return out


def _slug(value: Any) -> bool:
    return type(value) is str and value != "" and "\x00" not in value


def booking_body(data: Any, user: Any) -> dict | None:
    """validated(ReservationCreateSerializer, request)'s answer for request.data and request.user, or None
    where the serializer must judge the body."""
    if type(data) is not dict or not _REQUIRED <= data.keys() <= _KNOWN:
        return None
    if not getattr(user, "is_authenticated", False):
        return None
    count = data["node_count"]
    if type(count) is not int or not _COUNT.min_value <= count <= _COUNT.max_value:
        return None
    start, end = _aware(data["start"]), _aware(data["end"])
    if start is None or end is None:
        return None
    name = data.get("name", _NAME.default)
    if type(name) is not str:
        return None
    name = name.strip()
    if len(name) > _NAME.max_length or _ODD_IN_NAME.search(name):
        return None
    if "cluster" in data:
        cluster = _cluster(data["cluster"])
        if cluster is None:
            return None
    if not (_slug(data["tenant"]) and _slug(data["pool"])):
        return None
    tenant = _FIELDS["tenant"].find(user, data["tenant"])
    if tenant is None:
        return None
    pool = _FIELDS["pool"].find(user, data["pool"])
    if pool is None:
        return None
    out = {"tenant": tenant, "pool": pool, "node_count": count, "start": start, "end": end, "name": name}
    if "cluster" in data:
        out["cluster"] = cluster
    return out
