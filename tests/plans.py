"""Reading PostgreSQL's EXPLAIN (ANALYZE, FORMAT JSON) plans in tests that pin how much a statement reads."""

from __future__ import annotations

from typing import Any


def rows_read(plan: dict[str, Any], relation: str) -> int:
    """Rows the plan read from relation: the rows it returned plus those its filters threw away."""
    total = 0
    if plan.get("Relation Name") == relation:
        total += plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0) \
            + plan.get("Rows Removed by Index Recheck", 0)
    for sub in plan.get("Plans", []):
        total += rows_read(sub, relation)
    return total
