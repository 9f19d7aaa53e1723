"""Celery entry point of the domain events: the background subscribers of one event."""

from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(name="core.dispatch_event", ignore_result=True)
def dispatch_event(event: str, payload: dict[str, Any]) -> None:
    """Run the background subscribers of event. Each one is idempotent (ids in, re-read under a lock)."""
    from . import events

    events.dispatch_background(event, payload)
