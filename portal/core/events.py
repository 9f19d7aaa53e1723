"""Domain events: a lower app announces what happened; higher apps subscribe.

Handlers run after the surrounding transaction commits (never for a rolled-back write),
so a subscriber can enqueue Celery work that will find the rows it names.

Two kinds of subscriber:

- inline (the default): runs in the emitting process right after the commit. For cheap work
  that must happen before the caller returns (enqueueing a task, a metric).
- background (``subscribe(..., background=True)``): runs in a Celery worker, at least once.
  ``emit`` writes the event to the outbox table (``core.OutboxEvent``) inside the emitter's
  transaction, due at once, and after the commit wakes the relay: ``core.outbox_relay``, run by
  a worker, publishes one ``core.dispatch_event`` message per due row (with its id), whatever
  the number of background subscribers; the worker claims the row, runs them and deletes it (if
  one of them fails, the row stays and is retried after a backoff; ten claims and it is left
  for an operator). The wake-up is one Redis ``SET NX``: the commit that finds no relay run
  queued publishes one, the others of a burst publish nothing (the queued run finds their rows;
  it clears the flag before it looks, so a commit after that queues the next run). A booking
  request thus answers without creating the cluster, fanning out notifications or building a
  task message itself, and an event whose wake-up never left (the process died right after the
  commit, Redis or the broker was down) or whose message was lost is published by the relay's
  beat run (every 15 s) once its ``available_at`` has passed. Background subscribers must
  therefore be idempotent (they take ids and re-read). ``PORTAL_EVENTS_INLINE = True`` runs them in the
  emitting process after the commit instead (the in-process test suite).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import Error as DjangoDatabaseError
from django.db import connection, transaction

from .conf import setting_bool
from .locks import LOCK_OUTBOX_EVENT, advisory_lock

__all__ = [
    "subscribe", "unsubscribe", "emit", "outbox_wanted", "announce", "clear_subscribers", "dispatch_background",
    "outbox_dispatch", "outbox_relay", "outbox_requeue",
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


def _run(handlers: list[Handler], event: str, payload: dict[str, Any]) -> int:
    """Run handlers in order; return how many raised (each is logged; the others still run)."""
    failed = 0
    for handler in handlers:
        try:
            handler(event, payload)
        except Exception:  # a subscriber must never undo or block the committed write
            failed += 1
            logger.exception("event handler %r failed for %s", handler, event)
    return failed


def dispatch_background(event: str, payload: dict[str, Any]) -> int:
    """Run the background subscribers of event; return how many failed."""
    return _run(_handlers(_background, event), event, payload)


# How long a published message may take to reach a worker before the relay sends it again.
OUTBOX_PUBLISH_LEASE_S = 120
# A worker's claim holds the event for the task time limit and a margin: a slow but healthy run
# is never sent to a second worker meanwhile.
OUTBOX_CLAIM_MARGIN_S = 60
# After this many claims (the worker died, or a subscriber failed, each time) an event is left
# for an operator (admin: "publish again now"): a poison event must not cycle forever.
OUTBOX_MAX_ATTEMPTS = 10
# A claim whose subscribers failed is retried after attempts × this, at most the cap.
OUTBOX_RETRY_STEP_S = 60
OUTBOX_RETRY_MAX_S = 900
# How often a worker process says, in its log, that events are stuck: the beat's relay pace (every commit wakes
# a run, and a count over the whole table each time would say it per booking).
OUTBOX_STUCK_REPORT_S = 15
_stuck_reported_at: float | None = None

# Due at once: the relay publishes it (and leases it for OUTBOX_PUBLISH_LEASE_S) as soon as it runs.
# clock_timestamp(), not now(): now() is the start of the transaction, which for an event
# emitted late in a long transaction is already in the past (the backlog age is read from created_at).
_OUTBOX_INSERT = (
    "INSERT INTO core_outboxevent (event, payload, created_at, available_at, attempts) "
    "VALUES (%s, %s::jsonb, clock_timestamp(), clock_timestamp(), 0) RETURNING id"
)
# The relay's wake-up flag: set (NX) by the commit that queues a relay run, cleared by the run as it starts.
# While it is set, other commits queue nothing: the queued run will find their rows. A run that never
# starts (its message lost, no worker up) stops holding later commits back after this long.
RELAY_QUEUED_TTL_MS = 2000
_OUTBOX_CLAIM = (
    "UPDATE core_outboxevent SET attempts = attempts + 1,"
    " available_at = clock_timestamp() + make_interval(secs => %s)"
    " WHERE id = %s AND attempts < %s RETURNING event, payload, attempts"
)
# The due rows through the available_at index: clock_timestamp() compared row by row is volatile, no index
# condition, and the scan walked every leased row (sent, waiting for a worker) on each run; as a sub-select
# it is read once, when the statement runs (after its snapshot: a row committed before it is due by it).
# ARRAY(...) has the update find the rows by id, not hash-join a scan of the whole table.
_OUTBOX_DUE = (
    "UPDATE core_outboxevent SET available_at = clock_timestamp() + make_interval(secs => %s) WHERE id = ANY(ARRAY("
    "  SELECT id FROM core_outboxevent WHERE available_at <= (SELECT clock_timestamp()) AND attempts < %s"
    "  ORDER BY available_at LIMIT %s FOR UPDATE SKIP LOCKED)) RETURNING id"
)


def _claim_lease_s() -> int:
    return int(getattr(settings, "CELERY_TASK_TIME_LIMIT", None) or 600) + OUTBOX_CLAIM_MARGIN_S


def _jsonable(payload: dict[str, Any]) -> str:
    return json.dumps(payload, cls=DjangoJSONEncoder)


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


def _relay_queued_key() -> str:
    from .throttle import redis_key

    return redis_key("outbox", "relay-queued")


def _wake_relay() -> None:
    """Queue a relay run (core.outbox_relay) for the events just committed, unless one is queued already.

    Never raises: an event whose wake-up could not be sent is due, and the relay's beat run publishes it.
    """
    import redis

    from .tasks import outbox_relay
    from .throttle import redis_client

    client, key = redis_client(), _relay_queued_key()
    try:
        if not client.set(key, "1", nx=True, px=RELAY_QUEUED_TTL_MS):
            return  # a run is queued and has not started: it will find these rows
    except (redis.RedisError, OSError) as exc:  # no flag to share: queue a run of our own
        logger.warning("outbox: could not read the relay's flag (%s); queueing a run", exc.__class__.__name__)
        client = None
    try:
        outbox_relay.apply_async(retry=True, retry_policy={"max_retries": 1, "interval_start": 0.1,
                                                           "interval_step": 0.1})
    except Exception:  # noqa: BLE001 - any broker error: the rows are due, the beat run publishes them
        logger.warning("could not queue the outbox relay; its beat run will publish the events", exc_info=True)
        if client is not None:  # let the next commit try again rather than wait out the flag
            try:
                client.delete(key)
            except (redis.RedisError, OSError):
                pass


def _relay_started() -> None:
    """A relay run is starting: clear the flag first, so a commit after this point queues the next run
    (this one may already have looked past its row)."""
    import redis

    from .throttle import redis_client

    try:
        redis_client().delete(_relay_queued_key())
    except (redis.RedisError, OSError) as exc:  # the flag expires by itself
        logger.warning("outbox: could not clear the relay's flag (%s)", exc.__class__.__name__)


def _due_now(outbox_ids: list[int]) -> None:
    """Hand events whose message could not be sent to the relay's next run (not after a lease)."""
    try:
        with connection.cursor() as cur:
            cur.execute("UPDATE core_outboxevent SET available_at = clock_timestamp() WHERE id = ANY(%s)",
                        [outbox_ids])
    except DjangoDatabaseError:  # after a commit: never fail the request over this
        logger.warning("outbox events %s stay due after their lease", outbox_ids, exc_info=True)


def _after_commit(event: str, payload: dict[str, Any], outbox_id: int | None, background_inline: bool) -> None:
    _run(_handlers(_subscribers, event), event, payload)
    if outbox_id is not None:
        _wake_relay()
    elif background_inline:
        # The payload as a worker would get it, so the in-process suite meets JSON too.
        dispatch_background(event, json.loads(_jsonable(payload)))


def outbox_wanted(event: str) -> bool:
    """Whether announcing event needs an outbox row written in the caller's transaction: it has background
    subscribers and they run in a worker (not inline, as PORTAL_EVENTS_INLINE has them)."""
    return bool(_handlers(_background, event)) and not setting_bool("PORTAL_EVENTS_INLINE", False)


def announce(event: str, payload: dict[str, Any], outbox_id: int | None) -> None:
    """After the caller's commit (at once outside a transaction): the inline subscribers, and the relay's wake-up
    for outbox_id, the row the caller wrote for event (when outbox_wanted said so; else None)."""
    background_inline = bool(_handlers(_background, event)) and setting_bool("PORTAL_EVENTS_INLINE", False)
    transaction.on_commit(lambda: _after_commit(event, payload, outbox_id, background_inline))


def emit(event: str, **payload: Any) -> None:
    """Announce event with a JSON-able payload: inline subscribers after the commit, background ones in a worker.

    With background subscribers the event is written to the outbox now, in the caller's
    transaction (so it commits or rolls back with the change it announces).
    """
    outbox_id = None
    if outbox_wanted(event):
        with connection.cursor() as cur:
            cur.execute(_OUTBOX_INSERT, [event, _jsonable(payload)])
            outbox_id = cur.fetchone()[0]
    announce(event, payload, outbox_id)


def outbox_dispatch(outbox_id: int) -> str:
    """Run the background subscribers of one outbox event (the worker's side); return what happened.

    "done": they ran and the row is deleted. "duplicate": the row is gone, a second message
    for an event already handled. "stuck": claimed OUTBOX_MAX_ATTEMPTS times already, left
    for an operator. "retry": a subscriber failed; the row stays and the relay sends it again
    after a backoff (the others ran; every background subscriber must be idempotent). "busy":
    another worker is running this event's subscribers right now (a second copy of its message,
    e.g. re-sent by the relay while the first waited in a queue); that worker sees it through.
    """
    # The lock says "a live worker has this event": a copy redelivered after its worker died
    # finds it free (PostgreSQL dropped the dead session's locks) and goes ahead at once.
    with advisory_lock(LOCK_OUTBOX_EVENT, outbox_id) as held:
        if not held:
            logger.info("outbox event %s is being handled by another worker; this copy leaves it", outbox_id)
            return "busy"
        return _dispatch_locked(outbox_id)


def _dispatch_locked(outbox_id: int) -> str:
    with connection.cursor() as cur:
        cur.execute(_OUTBOX_CLAIM, [_claim_lease_s(), outbox_id, OUTBOX_MAX_ATTEMPTS])
        row = cur.fetchone()
        if row is None:
            cur.execute("SELECT attempts FROM core_outboxevent WHERE id = %s", [outbox_id])
            stuck = cur.fetchone()
    if row is None:
        if stuck is None:
            return "duplicate"
        logger.error("outbox event %s was claimed %d times without finishing; left for an operator",
                     outbox_id, stuck[0])
        return "stuck"
    event, payload, attempts = row
    if isinstance(payload, str):  # a driver without the jsonb loader
        payload = json.loads(payload)
    if dispatch_background(event, payload):
        backoff = min(OUTBOX_RETRY_STEP_S * attempts, OUTBOX_RETRY_MAX_S)
        with connection.cursor() as cur:
            cur.execute("UPDATE core_outboxevent SET available_at = clock_timestamp() + make_interval(secs => %s)"
                        " WHERE id = %s", [backoff, outbox_id])
        logger.warning("outbox event %s (%s): a subscriber failed (attempt %d); retried in %d s",
                       outbox_id, event, attempts, backoff)
        return "retry"
    with connection.cursor() as cur:
        cur.execute("DELETE FROM core_outboxevent WHERE id = %s", [outbox_id])
    return "done"


def outbox_relay(*, limit: int = 500) -> list[int]:
    """Publish the outbox events that are due (just committed, lost, their worker died, or to retry)."""
    _relay_started()
    sent: list[int] = []
    # Batch after batch while they come full: the relay is the events' only way out, and what a woken run
    # leaves behind waits for the beat (a batch every 15 s) unless another commit lands. Each batch is leased
    # as it is taken, so the loop ends once the due rows are gone; it stops at a batch the broker refused.
    while True:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute(_OUTBOX_DUE, [OUTBOX_PUBLISH_LEASE_S, OUTBOX_MAX_ATTEMPTS, limit])
                due = sorted(row[0] for row in cur.fetchall())
        batch = [outbox_id for outbox_id in due if _publish(outbox_id)]
        sent.extend(batch)
        if len(batch) < len(due):
            _due_now(sorted(set(due) - set(batch)))
            break
        if len(due) < limit:
            break
    _report_stuck()
    return sent


def _report_stuck() -> None:
    """Log the stuck events, at most once per OUTBOX_STUCK_REPORT_S in this process (PortalOutboxStuck alerts)."""
    global _stuck_reported_at
    now = time.monotonic()
    if _stuck_reported_at is not None and now - _stuck_reported_at < OUTBOX_STUCK_REPORT_S:
        return
    _stuck_reported_at = now
    stuck = _stuck_count()
    if stuck:
        logger.error("%d outbox events were claimed %d times without finishing; left for an operator",
                     stuck, OUTBOX_MAX_ATTEMPTS)


def outbox_requeue(outbox_ids: list[int], *, actor: Any = None) -> int:
    """Give events (e.g. stuck ones, after their cause was fixed) a fresh set of attempts, due now; audited."""
    from .models import OutboxEvent
    from .services import audit_record

    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("UPDATE core_outboxevent SET attempts = 0, available_at = clock_timestamp()"
                        " WHERE id = ANY(%s) RETURNING id, event", [list(outbox_ids)])
            requeued = sorted(cur.fetchall())
        for outbox_id, event in requeued:
            audit_record(actor=actor, action="outbox.requeue", obj=OutboxEvent(pk=outbox_id), after={"event": event})
    return len(requeued)


def _stuck_count() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM core_outboxevent WHERE attempts >= %s", [OUTBOX_MAX_ATTEMPTS])
        return cur.fetchone()[0]
