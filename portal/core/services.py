"""Cross-cutting write helpers."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection, models, transaction
from django.utils import timezone

__all__ = ["audit_record", "refuse_stale", "sessions_prune"]

logger = logging.getLogger(__name__)

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


# The session engines that keep their sessions in django_session (cached_db reads Redis first, writes both).
_DB_SESSION_ENGINES = ("django.contrib.sessions.backends.db", "django.contrib.sessions.backends.cached_db")
# = ANY(ARRAY(...)): the batch's keys are looked up by index; with IN (subquery) PostgreSQL hash-joins
# them against a sequential scan of the whole table.
_SESSIONS_PRUNE = (
    "DELETE FROM django_session WHERE session_key = ANY(ARRAY(SELECT session_key FROM django_session"
    " WHERE expire_date < %s ORDER BY expire_date LIMIT %s FOR UPDATE SKIP LOCKED))"
)


def sessions_prune(*, now: datetime | None = None, batch: int = 10_000, max_batches: int = 50) -> int:
    """Delete expired sessions (beat, hourly); return how many went.

    Every sign-in writes a django_session row and Django deletes none by itself (its
    ``clearsessions`` is one unbounded DELETE that nothing ran). Batches of ``batch`` rows read off
    the expire_date index, each its own transaction, at most ``max_batches`` a run; SKIP LOCKED
    lets overlapping runs take disjoint rows. An expired session is no sign-in any more: its
    cookie already opens an empty session, so deleting it changes nothing a user sees.
    """
    if settings.SESSION_ENGINE not in _DB_SESSION_ENGINES:
        return 0
    cutoff = now or timezone.now()
    pruned = 0
    for _ in range(max_batches):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(_SESSIONS_PRUNE, [cutoff, batch])
            n = cur.rowcount
        pruned += n
        if n < batch:
            break
    if pruned:
        logger.info("pruned %d expired sessions", pruned)
    return pruned
