"""Celery entry points of the domain events: one outbox event's background subscribers, and the relay."""

from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(name="core.dispatch_event", ignore_result=True)
def dispatch_event(outbox_id: int | str, payload: dict[str, Any] | None = None) -> str:
    """Run the background subscribers of one outbox event. Each one is idempotent (ids in, re-read under a lock).

    A message queued by a release before the outbox carries (event, payload) instead of an id;
    it is handled as it was then, so a rolling deploy loses nothing.
    """
    from . import events

    if payload is not None:
        events.dispatch_background(str(outbox_id), payload)
        return "legacy"
    return events.outbox_dispatch(int(outbox_id))


@shared_task(name="core.outbox_relay", ignore_result=True)
def outbox_relay() -> int:
    """Publish the due outbox events (woken by a commit, or beat's run for those whose message never left or
    was lost); return how many."""
    from . import events

    return len(events.outbox_relay())


@shared_task(name="core.sessions_prune", ignore_result=True)
def sessions_prune() -> int:
    """Hourly (beat): delete expired sessions, a bounded batch at a time."""
    from . import services

    return services.sessions_prune()
