"""Domain events: a lower app announces what happened; higher apps subscribe.

Handlers run after the surrounding transaction commits (never for a rolled-back write),
so a subscriber can enqueue Celery work that will find the rows it names.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from django.db import transaction

__all__ = ["subscribe", "unsubscribe", "emit", "clear_subscribers"]

logger = logging.getLogger(__name__)
Handler = Callable[[str, dict[str, Any]], None]
_subscribers: dict[str, list[Handler]] = defaultdict(list)


def subscribe(event: str, handler: Handler) -> None:
    """Register handler for event ("*" receives every event)."""
    if handler not in _subscribers[event]:
        _subscribers[event].append(handler)


def unsubscribe(event: str, handler: Handler) -> None:
    if handler in _subscribers.get(event, []):
        _subscribers[event].remove(handler)


def clear_subscribers() -> None:
    _subscribers.clear()


def _dispatch(event: str, payload: dict[str, Any]) -> None:
    for handler in [*_subscribers.get(event, []), *_subscribers.get("*", [])]:
        try:
            handler(event, payload)
        except Exception:  # a subscriber must never undo or block the committed write
            logger.exception("event handler %r failed for %s", handler, event)


def emit(event: str, **payload: Any) -> None:
    """Dispatch event with a JSON-able payload once the current transaction commits."""
    transaction.on_commit(lambda: _dispatch(event, payload))
