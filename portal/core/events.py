"""Domain events: a lower app announces what happened; higher apps subscribe.

Handlers run after the surrounding transaction commits (never for a rolled-back write),
so a subscriber can enqueue Celery work that will find the rows it names.

Two kinds of subscriber:

- inline (the default): runs in the emitting process right after the commit. For cheap work
  that must happen before the caller returns (enqueueing a task, a metric).
- background (``subscribe(..., background=True)``): runs in a Celery worker, at least once.
  ``emit`` writes the event to the outbox table (``core.OutboxEvent``) inside the emitter's
  transaction, and after the commit publishes one ``core.dispatch_event`` message with the
  row's id, whatever the number of background subscribers; the worker runs them and deletes
  the row. A booking request thus answers without creating the cluster or fanning out
  notifications itself, and an event whose message never left (the process died right after
  the commit, the broker was down) or was lost is published again by ``core.outbox_relay``
  (beat) once its ``available_at`` has passed. Background subscribers must therefore be
  idempotent (they take ids and re-read). ``PORTAL_EVENTS_INLINE = True`` runs them in the
  emitting process after the commit instead (the in-process test suite).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connection, transaction

from .conf import setting_bool

__all__ = [
    "subscribe", "unsubscribe", "emit", "clear_subscribers", "dispatch_background", "outbox_dispatch", "outbox_relay",
    "outbox_requeue",
]

logger = logging.getLogger(__name__)
Handler = Callable[[str, dict[str, Any]], None]
_subscribers: dict[str, list[Handler]] = defaultdict(list)
_background: dict[str, list[Handler]] = defaultdict(list)


def subscribe(event: str, handler: Handler, *, background: bool = False) -> None:
    """Register handler for event ("*" receives every event); background ones run in a worker."""
    registry = _background if background else _subscribers
    if handler not in registry[event]:
        registry[event].append(handler)


def unsubscribe(event: str, handler: Handler) -> None:
    for registry in (_subscribers, _background):
        if handler in registry.get(event, []):
            registry[event].remove(handler)


def clear_subscribers() -> None:
    _subscribers.clear()
    _background.clear()


def _handlers(registry: dict[str, list[Handler]], event: str) -> list[Handler]:
    return [*registry.get(event, []), *registry.get("*", [])]


def _run(handlers: list[Handler], event: str, payload: dict[str, Any]) -> None:
    for handler in handlers:
        try:
            handler(event, payload)
        except Exception:  # a subscriber must never undo or block the committed write
            logger.exception("event handler %r failed for %s", handler, event)


def dispatch_background(event: str, payload: dict[str, Any]) -> None:
    """Run the background subscribers of event (the core.dispatch_event task calls this)."""
    _run(_handlers(_background, event), event, payload)


# How long a published event may take before the relay publishes it again. A worker that
# claims it pushes this forward by the same amount, so only a stuck or lost one is repeated.
OUTBOX_LEASE_S = 120
# After this many claims (the worker died in each) the relay leaves the event alone and
# logs it: a poison event must not cycle through the workers forever.
OUTBOX_MAX_ATTEMPTS = 10

_OUTBOX_INSERT = (
    "INSERT INTO core_outboxevent (event, payload, created_at, available_at, attempts) "
    "VALUES (%s, %s::jsonb, now(), now() + make_interval(secs => %s), 0) RETURNING id"
)
_OUTBOX_CLAIM = (
    "UPDATE core_outboxevent SET attempts = attempts + 1, available_at = now() + make_interval(secs => %s) "
    "WHERE id = %s RETURNING event, payload"
)
_OUTBOX_DUE = (
    "UPDATE core_outboxevent SET available_at = now() + make_interval(secs => %s) WHERE id IN ("
    "  SELECT id FROM core_outboxevent WHERE available_at <= now() AND attempts < %s"
    "  ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id"
)


def _publish(outbox_id: int) -> bool:
    """Send the message for one outbox row; False when the broker would not take it."""
    from .tasks import dispatch_event

    try:
        # One quick retry only: an event that cannot leave now is the relay's, not the request's.
        dispatch_event.apply_async(
            args=[outbox_id], retry=True, retry_policy={"max_retries": 1, "interval_start": 0.1, "interval_step": 0.1},
        )
    except Exception:  # noqa: BLE001 - any broker error: the row stays, the relay sends it later
        logger.warning("could not publish outbox event %s; the relay will", outbox_id, exc_info=True)
        return False
    return True


def _due_now(outbox_ids: list[int]) -> None:
    """Hand events whose message could not be sent to the relay's next run (not after a lease)."""
    try:
        with connection.cursor() as cur:
            cur.execute("UPDATE core_outboxevent SET available_at = now() WHERE id = ANY(%s)", [outbox_ids])
    except DatabaseError:
        logger.warning("outbox events %s stay due after their lease", outbox_ids, exc_info=True)


def _after_commit(event: str, payload: dict[str, Any], outbox_id: int | None) -> None:
    _run(_handlers(_subscribers, event), event, payload)
    if outbox_id is not None:
        if not _publish(outbox_id):
            _due_now([outbox_id])
    elif _handlers(_background, event) and setting_bool("PORTAL_EVENTS_INLINE", False):
        dispatch_background(event, payload)


def emit(event: str, **payload: Any) -> None:
    """Announce event with a JSON-able payload: inline subscribers after the commit, background ones in a worker."""
    outbox_id = None
    if _handlers(_background, event) and not setting_bool("PORTAL_EVENTS_INLINE", False):
        with connection.cursor() as cur:
            cur.execute(_OUTBOX_INSERT, [event, json.dumps(payload, cls=DjangoJSONEncoder), OUTBOX_LEASE_S])
            outbox_id = cur.fetchone()[0]
    transaction.on_commit(lambda: _after_commit(event, payload, outbox_id))


def outbox_dispatch(outbox_id: int) -> bool:
    """Run the background subscribers of one outbox event and delete it (the worker's side).

    False when the row is gone: a duplicate message for an event already handled. A claim
    counts an attempt and extends the lease, so the relay leaves a running event alone.
    """
    with connection.cursor() as cur:
        cur.execute(_OUTBOX_CLAIM, [OUTBOX_LEASE_S, outbox_id])
        row = cur.fetchone()
    if row is None:
        return False
    event, payload = row
    if isinstance(payload, str):  # a driver without the jsonb loader
        payload = json.loads(payload)
    dispatch_background(event, payload)
    with connection.cursor() as cur:
        cur.execute("DELETE FROM core_outboxevent WHERE id = %s", [outbox_id])
    return True


def outbox_relay(*, limit: int = 500) -> list[int]:
    """Publish the outbox events whose lease has passed (never sent, lost, or their worker died)."""
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(_OUTBOX_DUE, [OUTBOX_LEASE_S, OUTBOX_MAX_ATTEMPTS, limit])
            due = sorted(row[0] for row in cur.fetchall())
    sent = [outbox_id for outbox_id in due if _publish(outbox_id)]
    if len(sent) < len(due):
        _due_now(sorted(set(due) - set(sent)))
    stuck = _stuck_count()
    if stuck:
        logger.error("%d outbox events were claimed %d times without finishing; left for an operator",
                     stuck, OUTBOX_MAX_ATTEMPTS)
    return sent


def outbox_requeue(outbox_ids: list[int]) -> int:
    """Give events (e.g. stuck ones, after their cause was fixed) a fresh set of attempts, due now."""
    with connection.cursor() as cur:
        cur.execute("UPDATE core_outboxevent SET attempts = 0, available_at = now() WHERE id = ANY(%s)",
                    [list(outbox_ids)])
        return cur.rowcount


def _stuck_count() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM core_outboxevent WHERE attempts >= %s", [OUTBOX_MAX_ATTEMPTS])
        return cur.fetchone()[0]
