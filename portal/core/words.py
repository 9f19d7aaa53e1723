"""Counts in words for messages people read: "1 node", "2 nodes" (no Django imports here)."""

from __future__ import annotations

__all__ = ["count_of"]


def count_of(count: int, singular: str, plural: str | None = None) -> str:
    """``count_of(1, "node")`` is "1 node"; ``count_of(3, "node")`` is "3 nodes"; irregular plurals are passed."""
    return f"{count} {singular if count == 1 else (plural or singular + 's')}"
