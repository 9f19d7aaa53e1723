"""Domain events: a lower app announces what happened; higher apps subscribe.

Handlers run after the surrounding transaction commits (never for a rolled-back write),
so a subscriber can enqueue Celery work that will find the rows it names.

Two kinds of subscriber:

- inline (the default): runs in the emitting process right after the commit. For cheap work
  that must happen before the caller returns (enqueueing a task, a metric).
- background (``subscribe(..., background=True)``): runs in a Celery worker. After the commit
  the emitting process publishes one ``core.dispatch_event`` message per event, whatever the
  number of background subscribers, and returns; the worker runs them. A booking request
  thus answers without creating the cluster or fanning out notifications itself. When the
  broker cannot take the message, the handlers run inline instead (slower, nothing lost).
  ``PORTAL_EVENTS_INLINE = True`` runs them inline always (the in-process test suite).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from django.db import transaction

from .conf import setting_bool

__all__ = ["subscribe", "unsubscribe", "emit", "clear_subscribers", "dispatch_background"]

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


def _after_commit(event: str, payload: dict[str, Any]) -> None:
    _run(_handlers(_subscribers, event), event, payload)
    if not _handlers(_background, event):
        return
    if setting_bool("PORTAL_EVENTS_INLINE", False):
        dispatch_background(event, payload)
        return
    from .tasks import dispatch_event

    try:
        dispatch_event.apply_async(
            args=[event, payload], retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1},
        )
    except Exception:  # noqa: BLE001 - any broker error: do the work here rather than lose it
        logger.warning("could not publish %s to the workers; running its handlers inline", event, exc_info=True)
        dispatch_background(event, payload)


def emit(event: str, **payload: Any) -> None:
    """Dispatch event with a JSON-able payload once the current transaction commits."""
    transaction.on_commit(lambda: _after_commit(event, payload))
