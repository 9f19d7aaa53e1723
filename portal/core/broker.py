"""Reading Celery's queues on its Redis broker (the metrics' queue depths, the health sweep's node agents)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["queue_lengths"]

# Celery's Redis transport (kombu) keeps a queue Q's messages of priority 3, 6 and 9 in the lists "Q\x06\x16<n>",
# beside Q's own list.
_PRIORITY_SUFFIXES = ("", *(f"\x06\x16{step}" for step in (3, 6, 9)))


def queue_lengths(client: Any, queues: Sequence[str]) -> dict[str, int]:
    """Messages waiting in each queue, every priority level counted, read in one round trip (client: a redis-py
    client)."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for suffix in _PRIORITY_SUFFIXES:
            pipe.llen(f"{queue}{suffix}")
    lengths = pipe.execute()
    per = len(_PRIORITY_SUFFIXES)
    return {queue: sum(lengths[i * per:(i + 1) * per]) for i, queue in enumerate(queues)}
