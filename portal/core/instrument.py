"""Instrumentation hooks: apps announce measurements, portal.ops (the top layer) records them.

A signal rather than an import, so the booking view never depends on the metrics module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.dispatch import Signal

__all__ = ["BookingTiming", "booking_finished", "timed_booking"]

# Sent once per booking request: outcome ("created" or the error envelope's code), seconds.
booking_finished = Signal()


class BookingTiming:
    """What timed_booking yields: give it the response, and the outcome is the code the client got."""

    outcome: str = "created"

    def answered(self, response, *, replayed: bool = False) -> None:
        """Take the outcome from the answer: "created" for a 2xx ("replayed" when it answered an
        Idempotency-Key's earlier booking again, which made nothing), else its error envelope's code."""
        if 200 <= response.status_code < 300:
            self.outcome = "replayed" if replayed else "created"
            return
        data = getattr(response, "data", None)
        code = data.get("code") if isinstance(data, dict) else None
        self.outcome = code if isinstance(code, str) else "error"


@contextmanager
def timed_booking() -> Iterator[BookingTiming]:
    """Time the block and announce its outcome.

    Wrapped around a whole DRF dispatch, the block hands its response to ``answered`` (refusals
    DRF makes before the view method runs, such as 401 and 429, are answers too); an exception
    that leaves the block is a 500 ("error") unless it is a domain error with an envelope code.
    """
    started = time.perf_counter()
    timing = BookingTiming()
    try:
        yield timing
    except BaseException as exc:
        code = getattr(exc, "code", None)
        timing.outcome = code if isinstance(code, str) else "error"
        raise
    finally:
        booking_finished.send(sender=None, outcome=timing.outcome, seconds=time.perf_counter() - started)
