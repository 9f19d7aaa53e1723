"""Instrumentation hooks: apps announce measurements, portal.ops (the top layer) records them.

A signal rather than an import, so the booking view never depends on the metrics module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.dispatch import Signal

__all__ = ["booking_finished", "timed_booking"]

# Sent once per booking request: outcome ("created" or the error envelope's code), seconds.
booking_finished = Signal()


@contextmanager
def timed_booking() -> Iterator[None]:
    """Time the block and announce its outcome, taken from the domain error it raised."""
    started = time.perf_counter()
    outcome = "created"
    try:
        yield
    except BaseException as exc:
        code = getattr(exc, "code", None) or getattr(exc, "default_code", None)
        outcome = code if isinstance(code, str) else "error"
        raise
    finally:
        booking_finished.send(sender=None, outcome=outcome, seconds=time.perf_counter() - started)
