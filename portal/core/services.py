"""Cross-cutting write helpers."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django.db import connection, models
from django.utils import timezone

__all__ = ["audit_record", "refuse_stale"]

# One fixed statement (no ORM compilation): every service write pays for it.
_AUDIT_INSERT = (
    "INSERT INTO core_auditlog (created_at, actor_id, action, object_type, object_id, tenant_id, before, after)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)"
)


def audit_record(
    *,
    actor: Any,
    action: str,
    obj: models.Model,
    tenant_id: int | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> None:
    """Write an audit row (core.AuditLog); call inside the service's transaction so both land or neither."""
    with connection.cursor() as cur:
        cur.execute(_AUDIT_INSERT, [
            timezone.now(), getattr(actor, "pk", None), action, obj._meta.label_lower, str(obj.pk), tenant_id,
            json.dumps(before or {}), json.dumps(after or {}),
        ])


def refuse_stale(stale: Iterable[str], *, by: str = "another admin or the API") -> None:
    """Refuse (InvalidState, nothing written) a change from an edit page whose shown values of the fields named in
    stale were changed since the page was opened (checked under the row's lock by the caller); no-op when none."""
    from .exceptions import InvalidState

    stale = sorted(stale)
    if stale:
        raise InvalidState(f"{', '.join(stale)}: changed since you opened this page (by {by}); nothing was saved. "
                           "Reload the page and make your change again.", fields={k: "Out of date." for k in stale})
