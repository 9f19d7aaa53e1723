"""Counts in the Slack messages read as words: "1 node is", "2 nodes are" (plain builders, no database)."""

from __future__ import annotations

import pytest

from notifications.slack import Event, build_message

BASE = "https://portal.example.com"
RESERVATION = {
    "tenant": "research", "tenant_name": "Research", "reservation_id": 42, "name": "llm-pretrain",
    "pool": "h100", "start": "2026-03-02T09:00:00Z", "end": "2026-03-02T17:00:00Z",
}


def _lead(message: dict) -> str:
    return message["blocks"][1]["text"]["text"]


@pytest.mark.parametrize(("count", "words"), [(1, "Its 1 node of `h100` is free again."),
                                              (3, "Its 3 nodes of `h100` are free again.")])
def test_a_cancelled_booking_says_its_nodes_are_free_in_agreement(count, words):
    message = build_message(Event.RESERVATION_CANCELLED, {**RESERVATION, "node_count": count}, BASE)

    assert words in _lead(message)  # was "Its 1 node of `h100` are free again."


@pytest.mark.parametrize(("used", "limit", "words"), [(1, 1, "(1 of 1 node)"), (4, 5, "(4 of 5 nodes)")])
def test_a_quota_alert_counts_the_quota_in_words_in_its_fallback_text(used, limit, words):
    payload = {"tenant": "research", "tenant_name": "Research", "pool": "h100", "used_nodes": used,
               "max_nodes": limit}

    message = build_message(Event.QUOTA_THRESHOLD, payload, BASE)

    # The notification text (what a phone shows) read "(1/1 nodes)".
    assert message["text"].endswith(f"pool h100 {words}"), message["text"]
