"""Celery entry points (queue ``notifications``): ids and plain JSON in, one service call each.

Every task is safe to run twice: fan-out is keyed, sending claims the row first. Messages are
acknowledged late (settings), so a worker killed mid-task leaves its message to be redelivered.
"""

from __future__ import annotations

from celery import shared_task
from django.db import DatabaseError

__all__ = ["fanout_task", "deliver_task", "sweep_task", "reminders_task", "prune_task", "quota_recheck_task"]

# Batches (of 10,000 deliveries) one hourly prune may take: 500,000, far more than an hour brings.
PRUNE_MAX_BATCHES = 50


@shared_task(
    name="notifications.fanout", acks_late=True, ignore_result=True,
    autoretry_for=(DatabaseError,), retry_backoff=True, retry_backoff_max=300, max_retries=10,
)
def fanout_task(event: str, payload: dict) -> int:
    """Turn a domain event into deliveries and queue them."""
    from .services import event_fanout

    return len(event_fanout(event=event, payload=payload))


@shared_task(bind=True, name="notifications.deliver", acks_late=True, ignore_result=True, max_retries=None)
def deliver_task(self, delivery_id: int) -> str:
    """Attempt one delivery; come back when the service says (backoff, Retry-After, rate limit, lease)."""
    from .services import MAX_COUNTDOWN_S, delivery_send

    try:
        result = delivery_send(delivery_id=delivery_id, worker=str(self.request.hostname or ""))
    except DatabaseError as exc:
        # The row stays open; the sweeper would find it, but coming back soon is kinder.
        raise self.retry(exc=exc, countdown=5)
    if result.retry_in is not None:
        raise self.retry(countdown=max(0.05, min(result.retry_in, MAX_COUNTDOWN_S)))
    return result.status


@shared_task(name="notifications.sweep", ignore_result=True)
def sweep_task() -> int:
    """Requeue open deliveries nobody is working on (lost messages, killed workers)."""
    from .services import deliveries_requeue_stuck

    return len(deliveries_requeue_stuck())


@shared_task(name="notifications.reminders", ignore_result=True)
def reminders_task() -> int:
    """Announce reservations starting in 1 h and ending in 24 h / 1 h (idempotent per reminder)."""
    from .services import reminders_emit

    return len(reminders_emit())


@shared_task(name="notifications.prune", ignore_result=True)
def prune_task() -> int:
    """Delete finished deliveries older than the retention period (hourly; up to PRUNE_MAX_BATCHES batches)."""
    from .services import deliveries_prune

    return deliveries_prune(max_batches=PRUNE_MAX_BATCHES)


@shared_task(name="notifications.quota_recheck", ignore_result=True)
def quota_recheck_task() -> int:
    """Re-measure every quota's alert state: bookings that ended, quotas edited (idempotent)."""
    from .services import quota_alerts_recheck

    return len(quota_alerts_recheck())
