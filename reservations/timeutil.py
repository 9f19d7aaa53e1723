"""Slot arithmetic: every booking boundary sits on the pool's slot grid (UTC epoch based)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

__all__ = ["slot_floor", "slot_ceil", "is_aligned", "EPOCH"]


def _seconds(dt: datetime) -> float:
    return (dt - EPOCH).total_seconds()


def slot_floor(dt: datetime, minutes: int) -> datetime:
    step = minutes * 60
    return EPOCH + timedelta(seconds=(int(_seconds(dt)) // step) * step)


def slot_ceil(dt: datetime, minutes: int) -> datetime:
    floor = slot_floor(dt, minutes)
    return floor if floor == dt else floor + timedelta(minutes=minutes)


def is_aligned(dt: datetime, minutes: int) -> bool:
    return dt.microsecond == 0 and int(_seconds(dt)) % (minutes * 60) == 0
