"""Domain-event subscriber: decide cheaply whether anyone listens, then queue the fan-out.

A background subscriber (portal.core.events): it runs in a Celery worker after the emitting
transaction committed, so the request that caused the event never waits for it. It must
never raise (portal.core.events logs and swallows anyway).
"""

from __future__ import annotations

import logging
from typing import Any

from . import selectors

__all__ = ["on_event"]

logger = logging.getLogger(__name__)


def on_event(event: str, payload: dict[str, Any]) -> None:
    """Queue notifications.fanout for an event we translate and someone may want."""
    if not selectors.handles(event):
        return  # unknown or uninteresting events are ignored by design
    from .services import demo_channel_ensure
    from .tasks import fanout_task

    demo_channel_ensure()
    if not selectors.anyone_listening(event, payload):
        return
    fanout_task.delay(event, selectors.jsonable(payload))
