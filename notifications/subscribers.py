"""Domain-event subscriber: decide cheaply whether anyone listens, then queue the fan-out.

Runs in the emitting process after its transaction commits, so it must be quick and must
never raise into the caller (portal.core.events logs and swallows anyway).
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
