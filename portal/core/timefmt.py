"""The one way the portal writes an instant as text: UTC, whole seconds, a Z (no Django imports here)."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["format_utc"]


def format_utc(value: datetime) -> str:
    """2026-01-05T09:00:00Z. Not strftime("%Y"): glibc does not zero-pad years below 1000."""
    v = value.astimezone(UTC)
    return f"{v.year:04d}-{v.month:02d}-{v.day:02d}T{v.hour:02d}:{v.minute:02d}:{v.second:02d}Z"
