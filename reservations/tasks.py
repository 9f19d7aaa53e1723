"""Celery entry points of the reservations app: thin, rerunnable, no arguments but ids.

The per-slot availability summary (migration 0006) is kept by PostgreSQL itself: the triggers
append deltas, services.slot_usage_compact folds them in (compaction). It is one SQL function,
safe to run at any time and from several processes at once.
"""

from __future__ import annotations

import logging

from celery import shared_task

logger = logging.getLogger(__name__)

# Batches (of 10,000 keys) one hourly prune may take: 500,000 keys, far more than an hour brings.
PRUNE_MAX_BATCHES = 50

__all__ = ["slot_usage_compact_task", "idempotency_keys_prune_task"]


@shared_task(name="reservations.slot_usage_compact", ignore_result=True)
def slot_usage_compact_task() -> int:
    """Every 10 s (beat): fold the availability deltas written since the last run into the per-slot rows."""
    from .services import slot_usage_compact

    moved = slot_usage_compact()
    if moved:
        logger.debug("slot usage compaction moved %d deltas", moved)
    return moved


@shared_task(name="reservations.idempotency_keys_prune", ignore_result=True)
def idempotency_keys_prune_task() -> int:
    """Hourly (beat): forget Idempotency-Keys past their replay period, up to PRUNE_MAX_BATCHES batches."""
    from .services import idempotency_keys_prune

    return idempotency_keys_prune(max_batches=PRUNE_MAX_BATCHES)
