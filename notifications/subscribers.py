"""Domain-event subscriber: decide cheaply whether anyone listens, then queue the fan-out.

A background subscriber (portal.core.events): it runs in a Celery worker after the emitting
transaction committed, so the request that caused the event never waits for it. It fans the
event out itself, in that worker, rather than queueing notifications.fanout: the outbox row is
deleted when this returns, and a fan-out message lost after that (a Redis restart, a flushed
queue) left nothing behind that any relay or sweeper could find — no outbox row, no Delivery.
Once the deliveries exist (committed), their rows are the source of truth (the sweeper). A
failure raises, so the outbox keeps the event and runs it again (fan-out is keyed: idempotent).
"""

from __future__ import annotations

import logging
from typing import Any

from tenants.services import SLACK_WEBHOOK_SET

from . import selectors

__all__ = ["on_event"]

logger = logging.getLogger(__name__)


def on_event(event: str, payload: dict[str, Any]) -> None:
    """Queue notifications.fanout for an event we translate and someone may want."""
    if event == SLACK_WEBHOOK_SET:
        from .services import slack_channel_added

        tenant_id = selectors.as_id(payload.get("tenant_id"))
        if tenant_id is not None:
            slack_channel_added(tenant_id=tenant_id)
        return
    if not selectors.handles(event):
        return  # unknown or uninteresting events are ignored by design
    from .services import demo_channel_ensure, event_fanout

    demo_channel_ensure()
    if not selectors.anyone_listening(event, payload):
        return
    event_fanout(event=event, payload=selectors.jsonable(payload))
