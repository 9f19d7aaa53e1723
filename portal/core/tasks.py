"""Celery entry points of the domain events: one outbox event's background subscribers, and the relay."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="core.dispatch_event", ignore_result=True)
def dispatch_event(outbox_id: int) -> None:
    """Run the background subscribers of one outbox event. Each one is idempotent (ids in, re-read under a lock)."""
    from . import events

    events.outbox_dispatch(outbox_id)


@shared_task(name="core.outbox_relay", ignore_result=True)
def outbox_relay() -> int:
    """Publish again the outbox events whose message never left or was lost; return how many."""
    from . import events

    return len(events.outbox_relay())
