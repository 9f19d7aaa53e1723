"""Block Kit builders: every event renders a valid message within Slack's limits, safely."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from notifications import slack
from notifications.slack import Event, build_message, escape, fit, link, slack_date, validate_message

BASE = "https://portal.example.com"
START = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
END = START + timedelta(days=2, hours=3)

RESERVATION = {
    "tenant": "research",
    "tenant_name": "Research & Dev",
    "reservation_id": 42,
    "name": "llm-pretrain",
    "pool": "h100-sxm",
    "node_count": 4,
    "start": START,
    "end": END,
    "billing": "committed",
    "nodes": ["h100-sxm-001", "h100-sxm-002", "h100-sxm-003", "h100-sxm-004"],
    "orchestrator": "slurm",
    "cuda_version": "12.4",
    "actor": "alice",
}

SAMPLES: dict[Event, dict[str, Any]] = {
    Event.RESERVATION_CONFIRMED: RESERVATION,
    Event.RESERVATION_CHANGED: {
        **RESERVATION,
        "previous_end": END - timedelta(days=1),
        "previous_node_count": 2,
    },
    Event.RESERVATION_CANCELLED: {**RESERVATION, "reason": "plans changed"},
    Event.RESERVATION_STARTING_1H: RESERVATION,
    Event.RESERVATION_ENDING_24H: RESERVATION,
    Event.RESERVATION_ENDING_1H: RESERVATION,
    Event.CLUSTER_READY: {**RESERVATION, "cluster_id": 7, "access": "ssh research@login.h100.example.com"},
    Event.CLUSTER_FAILED: {
        **RESERVATION,
        "cluster_id": 7,
        "phase": "installing_drivers",
        "reason": "nvidia-driver 550 failed to load",
    },
    Event.CLUSTER_DEGRADED: {
        **RESERVATION,
        "cluster_id": 7,
        "nodes": ["h100-sxm-003"],
        "reason": "XID 79 on GPU 3",
    },
    Event.CLUSTER_CREDENTIALS_RENEWED: {
        **RESERVATION,
        "cluster_id": 7,
        "orchestrator": "kubernetes",
        "expires_at": START + timedelta(hours=2),
        "previous_expires_at": START + timedelta(hours=1),
    },
    Event.NODE_FAILED: {"tenant": "research", "reservation_id": 42, "name": "llm-pretrain", "node": "h100-sxm-003"},
    Event.NODE_REPLACED: {
        "tenant": "research",
        "reservation_id": 42,
        "cluster_id": 7,
        "node": "h100-sxm-003",
        "replacement": "h100-sxm-009",
        "reason": "ECC errors",
    },
    Event.HEALTH_CHECK_FAILED: {
        "tenant": "research",
        "reservation_id": 42,
        "cluster_id": 7,
        "node": "h100-sxm-003",
        "level": "medium",
        "verdict": "fail",
        "failures": ["GPU 3: dcgm diag level 2 failed (PCIe)", "GPU 5: row remap pending"],
    },
    Event.QUOTA_THRESHOLD: {"tenant": "research", "pool": "h100-sxm", "used_nodes": 7, "max_nodes": 8},
    Event.TEST: {"tenant": "research", "actor": "alice"},
}


def _all_texts(message: dict[str, Any]) -> list[str]:
    """Every text string in the message, gathered without the module's own validator."""
    texts = [message["text"]]
    for block in message["blocks"]:
        if "text" in block:
            texts.append(block["text"]["text"])
        texts += [f["text"] for f in block.get("fields", [])]
        texts += [e["text"] for e in block.get("elements", [])]
    return texts


def _assert_within_limits(message: dict[str, Any]) -> None:
    assert set(message) == {"text", "blocks"}
    assert message["text"].strip() and len(message["text"]) <= 3000
    blocks = message["blocks"]
    assert 1 <= len(blocks) <= 50
    for block in blocks:
        assert block["type"] in {"header", "section", "context", "divider"}
        if block["type"] == "header":
            assert block["text"]["type"] == "plain_text"
            assert 0 < len(block["text"]["text"]) <= 150
        if block["type"] == "section":
            assert block["text"]["type"] == "mrkdwn"
            assert 0 < len(block["text"]["text"]) <= 3000
            assert len(block.get("fields", [])) <= 10
            assert all(f["type"] == "mrkdwn" and 0 < len(f["text"]) <= 2000 for f in block.get("fields", []))
        if block["type"] == "context":
            assert 1 <= len(block["elements"]) <= 10
    json.dumps(message)  # plain JSON, nothing exotic
    assert validate_message(message) == []


def test_every_event_has_a_sample() -> None:
    assert set(SAMPLES) == set(Event) == slack.EVENTS


@pytest.mark.parametrize("event", list(Event))
def test_every_event_builds_a_valid_message(event: Event) -> None:
    message = build_message(event, SAMPLES[event], BASE)
    _assert_within_limits(message)
    blocks = message["blocks"]
    assert blocks[0]["type"] == "header"
    assert blocks[-1]["type"] == "context"
    assert f"`{event.value}`" in blocks[-1]["elements"][0]["text"]
    assert f"<{BASE}/|GPU Portal>" in blocks[-1]["elements"][0]["text"]


@pytest.mark.parametrize("event", [e for e in Event if e.value.startswith("reservation.")])
def test_reservation_messages_link_back_and_show_times_both_ways(event: Event) -> None:
    message = build_message(event, SAMPLES[event], BASE)
    body = "\n".join(_all_texts(message))
    assert f"<{BASE}/reservations/42/|llm-pretrain>" in body
    # Slack renders <!date^…> in each reader's zone; the UTC ISO time is the fallback and is shown too.
    assert f"<!date^{int(START.timestamp())}^" in body and f"<!date^{int(END.timestamp())}^" in body
    assert "2025-03-01T09:00:00Z" in body and "2025-03-03T12:00:00Z" in body
    assert "2025-03-01T09:00:00Z" in message["text"]  # phone notifications see the window too
    assert "Research &amp; Dev" in body  # the display name, escaped
    assert "2 d 3 h" in body


@pytest.mark.parametrize(
    "event", [Event.CLUSTER_READY, Event.CLUSTER_FAILED, Event.CLUSTER_DEGRADED, Event.HEALTH_CHECK_FAILED,
              Event.CLUSTER_CREDENTIALS_RENEWED]
)
def test_cluster_messages_link_to_the_cluster(event: Event) -> None:
    body = "\n".join(_all_texts(build_message(event, SAMPLES[event], BASE)))
    assert f"<{BASE}/clusters/7/|" in body


def test_change_shows_old_and_new_values() -> None:
    message = build_message(Event.RESERVATION_CHANGED, SAMPLES[Event.RESERVATION_CHANGED], BASE)
    fields = [f["text"] for f in message["blocks"][1]["fields"]]
    end_field = next(f for f in fields if f.startswith("*End*"))
    assert "~2025-03-02T12:00:00Z~" in end_field and "2025-03-03T12:00:00Z" in end_field
    assert "*Nodes*\n~2~ → 4" in fields
    start_field = next(f for f in fields if f.startswith("*Start*"))
    assert "~" not in start_field  # unchanged values are not struck through


def test_specific_content() -> None:
    def body(event: Event) -> str:
        return "\n".join(_all_texts(build_message(event, SAMPLES[event], BASE)))

    assert "`h100-sxm-003`" in body(Event.NODE_REPLACED) and "`h100-sxm-009`" in body(Event.NODE_REPLACED)
    assert "row remap pending" in body(Event.HEALTH_CHECK_FAILED)
    assert "```nvidia-driver 550 failed to load```" in body(Event.CLUSTER_FAILED)
    assert "ssh research@login.h100.example.com" in body(Event.CLUSTER_READY)
    quota = build_message(Event.QUOTA_THRESHOLD, SAMPLES[Event.QUOTA_THRESHOLD], BASE)
    assert quota["blocks"][0]["text"]["text"] == ":bar_chart: Quota 88 % used"
    assert "7 of its 8 guaranteed nodes" in quota["blocks"][1]["text"]["text"]
    assert "in about 24 hours" in body(Event.RESERVATION_ENDING_24H)
    assert "in about 1 hour" in body(Event.RESERVATION_ENDING_1H)


def test_user_text_cannot_mention_or_inject_links() -> None:
    evil = "<!channel> & <https://evil.example|click me> <@U024BE7LH>"
    payload = {**RESERVATION, "name": evil, "actor": "<!here>", "reason": evil, "tenant_name": "<!everyone>"}
    for event in (Event.RESERVATION_CONFIRMED, Event.RESERVATION_CANCELLED, Event.RESERVATION_CHANGED):
        message = build_message(event, payload, BASE)
        raw = json.dumps(message)
        for token in ("<!channel>", "<!here>", "<!everyone>", "<@U024BE7LH>", "<https://evil"):
            assert token not in raw
        texts = _all_texts(message)
        assert any("&lt;!channel&gt; &amp; &lt;https://evil.example¦click me&gt;" in t for t in texts)
        assert "&lt;!channel&gt;" in message["text"]
        # Every '&' that reaches Slack starts an entity we wrote.
        for text in texts:
            assert not re.search(r"&(?!amp;|lt;|gt;)", text), text


def test_limits_hold_for_huge_inputs() -> None:
    payload = {
        **RESERVATION,
        "name": "n" * 5000,
        "tenant_name": "&" * 5000,
        "reason": "<x>" * 5000,
        "nodes": [f"node-{i:05d}-" + "x" * 150 for i in range(2000)],
        "failures": [f"GPU {i}: " + "e" * 300 for i in range(500)],
        "node": "h" * 1000,
        "cluster_id": 7,
    }
    for event in Event:
        message = build_message(event, {**SAMPLES[event], **payload}, BASE)
        _assert_within_limits(message)
    degraded = build_message(Event.CLUSTER_DEGRADED, {**SAMPLES[Event.CLUSTER_DEGRADED], **payload}, BASE)
    nodes_text = next(t for t in _all_texts(degraded) if t.startswith("*Affected nodes (2000)*"))
    assert nodes_text.endswith("more")
    reason_text = next(t for t in _all_texts(degraded) if t.startswith("*Reason*"))
    assert reason_text.endswith("…```") and len(reason_text) <= 3000
    health = build_message(Event.HEALTH_CHECK_FAILED, {**SAMPLES[Event.HEALTH_CHECK_FAILED], **payload}, BASE)
    failures = next(t for t in _all_texts(health) if t.startswith("*Failures*"))
    listed = failures.count("\n• ")
    assert 1 <= listed < 20 and failures.endswith(f"… and {500 - listed} more")
    few = build_message(Event.HEALTH_CHECK_FAILED, {**SAMPLES[Event.HEALTH_CHECK_FAILED], "failures": ["x"] * 25}, BASE)
    assert any(t.count("\n• x") == 20 and t.endswith("… and 5 more") for t in _all_texts(few))


def test_fit_never_cuts_an_entity_or_a_link() -> None:
    assert fit("short", 10) == "short"
    assert fit("ab&amp;cd", 5) == "ab…"
    assert fit("see <https://x.example/a|label> now", 12) == "see …"
    assert fit("x" * 20, 10) == "x" * 9 + "…"
    assert len(fit("&amp;" * 1000, 3000)) <= 3000


def test_escape_and_link() -> None:
    assert escape("a & <b> > c") == "a &amp; &lt;b&gt; &gt; c"
    assert link("https://p.example/r/1/?a=1&b=2", "x|y <z>") == "<https://p.example/r/1/?a=1&amp;b=2|x¦y &lt;z&gt;>"


def test_slack_date_and_iso() -> None:
    when = datetime(2025, 3, 1, 10, 30, tzinfo=timezone(timedelta(hours=1)))
    assert slack_date(when) == "<!date^1740821400^{date_short_pretty} {time}|2025-03-01T09:30:00Z>"
    assert slack.iso_utc("2025-03-01T10:30:00+01:00") == "2025-03-01T09:30:00Z"


def test_iso_strings_are_accepted_as_payload_datetimes() -> None:
    payload = {**RESERVATION, "start": "2025-03-01T11:00:00+02:00", "end": "2025-03-03T12:00:00Z"}
    message = build_message(Event.RESERVATION_CONFIRMED, payload, BASE)
    assert "2025-03-01T09:00:00Z" in message["text"]


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown notification event"):
        build_message("reservation.exploded", RESERVATION, BASE)
    with pytest.raises(ValueError, match="missing reservation_id"):
        build_message(Event.RESERVATION_CONFIRMED, {**RESERVATION, "reservation_id": None}, BASE)
    with pytest.raises(ValueError, match="timezone-aware"):
        build_message(Event.RESERVATION_CONFIRMED, {**RESERVATION, "start": datetime(2025, 3, 1, 9)}, BASE)
    with pytest.raises(ValueError, match="ISO 8601"):
        build_message(Event.RESERVATION_CONFIRMED, {**RESERVATION, "end": "tomorrow"}, BASE)
    with pytest.raises(ValueError, match="base_url"):
        build_message(Event.TEST, {}, "portal.example.com")


def test_url_override_and_trailing_slash_in_base() -> None:
    message = build_message(Event.RESERVATION_CONFIRMED, {**RESERVATION, "url": "https://x.example/r/42"}, BASE + "/")
    assert "<https://x.example/r/42|llm-pretrain>" in message["blocks"][1]["text"]["text"]
    assert "<https://portal.example.com/|GPU Portal>" in message["blocks"][-1]["elements"][0]["text"]


def test_test_message_needs_nothing() -> None:
    message = build_message(Event.TEST, {}, BASE)
    _assert_within_limits(message)
    assert message["text"] == "Test message from GPU Portal"


def test_validate_message_reports_problems() -> None:
    bad = {
        "text": "",
        "blocks": [{"type": "actions"}, {"type": "section", "text": {"type": "mrkdwn", "text": "x" * 3001}}] * 26,
    }
    problems = validate_message(bad)
    assert "text fallback is empty" in problems
    assert "52 blocks (max 50)" in problems
    assert any("unknown block type" in p for p in problems)
    assert any("3001 characters (max 3000)" in p for p in problems)


def test_to_body_is_compact_utf8_json() -> None:
    message = build_message(Event.RESERVATION_CONFIRMED, {**RESERVATION, "name": "ünï → ok"}, BASE)
    body = slack.to_body(message)
    assert isinstance(body, bytes)
    assert json.loads(body.decode("utf-8")) == message
    assert "ünï → ok".encode() in body


@pytest.mark.parametrize("event", list(Event))
def test_every_mrkdwn_text_is_verbatim_so_tenant_text_is_not_linkified(event: Event) -> None:
    """Slack turns bare URLs and #names in mrkdwn into links unless the text object is verbatim: a failure
    line or a name with https://… in it stays text; the portal's own links are explicit <url|label>."""
    message = build_message(event, SAMPLES[event], BASE)

    def objects(node: Any):
        if isinstance(node, dict):
            if node.get("type") == "mrkdwn":
                yield node
            for value in node.values():
                yield from objects(value)
        elif isinstance(node, list):
            for value in node:
                yield from objects(value)

    found = list(objects(message["blocks"]))
    assert found and all(o.get("verbatim") is True for o in found)


ZW = "\u200b"


def test_user_text_cannot_format_the_message() -> None:
    """A reservation called *urgent* (or ~x~, _y_, `z`) shows those characters, not bold, strike, italics or code:
    Slack has no escape for them, so each one typed by a user is fenced off by zero-width spaces."""
    payload = {**RESERVATION, "name": "*urgent* ~x~ _y_ `z`", "tenant_name": "_team_", "actor": "*bob*",
               "reason": "~struck~", "cluster_id": 7}
    for event in (Event.RESERVATION_CONFIRMED, Event.RESERVATION_CANCELLED, Event.CLUSTER_FAILED):
        message = build_message(event, payload, BASE)
        texts = _all_texts(message)
        for raw in ("*urgent*", "~x~", "_y_", "`z`", "_team_", "*bob*"):
            assert not any(raw in t for t in texts), (event, raw)
        body = "\n".join(texts)
        assert f"{ZW}*{ZW}urgent{ZW}*{ZW}" in body
        assert f"{ZW}_{ZW}team{ZW}_{ZW}" in body
        # Without the fences, the name reads as typed.
        assert any("*urgent* ~x~ _y_ 'z'" in t.replace(ZW, "") or "*urgent* ~x~ _y_ `z`" in t.replace(ZW, "")
                   for t in texts)
    health = build_message(Event.HEALTH_CHECK_FAILED, {**SAMPLES[Event.HEALTH_CHECK_FAILED],
                                                       "failures": ["GPU 1: *bold* failure"]}, BASE)
    assert not any("*bold*" in t for t in _all_texts(health))


def test_code_spans_stay_copyable() -> None:
    """Inside code (hostnames, the access command, a reason's code block) nothing is formatted: no fences there,
    so a command copied from Slack runs."""
    payload = {**RESERVATION, "cluster_id": 7, "access": "ssh my_team@login_1.example.com",
               "nodes": ["gpu_node_1"], "pool": "h100_sxm"}
    body = "\n".join(_all_texts(build_message(Event.CLUSTER_READY, payload, BASE)))
    assert "ssh my_team@login_1.example.com" in body
    assert "`gpu_node_1`" in body and "`h100_sxm`" in body


def test_a_health_check_without_a_level_reads_as_one() -> None:
    """A check whose level is not known read "A *health* health check on node …"."""
    payload = {k: v for k, v in SAMPLES[Event.HEALTH_CHECK_FAILED].items() if k != "level"}
    lead = build_message(Event.HEALTH_CHECK_FAILED, payload, BASE)["blocks"][1]["text"]["text"]
    assert lead.startswith("A health check on node `h100-sxm-003`") and "health* health" not in lead
    with_level = build_message(Event.HEALTH_CHECK_FAILED, SAMPLES[Event.HEALTH_CHECK_FAILED], BASE)
    assert with_level["blocks"][1]["text"]["text"].startswith("A *medium* health check on node")


def test_a_failed_cluster_says_what_became_of_the_booking() -> None:
    """cluster.failed said "the reservation keeps its nodes", but a cluster that fails for good fails its booking
    and the nodes go back to the pool (reservation_set_status → failed); a teardown that failed is no provisioning."""
    lead = build_message(Event.CLUSTER_FAILED, SAMPLES[Event.CLUSTER_FAILED], BASE)["blocks"][1]["text"]["text"]
    assert "keeps its nodes" not in lead
    assert "Provisioning the cluster" in lead and "booking has failed" in lead and "nodes were released" in lead
    teardown = build_message(Event.CLUSTER_FAILED, {**SAMPLES[Event.CLUSTER_FAILED], "phase": "tearing_down"}, BASE)
    lead = teardown["blocks"][1]["text"]["text"]
    assert "Provisioning" not in lead and "Tearing down the cluster" in lead and "keeps its nodes" not in lead
    assert teardown["blocks"][0]["text"]["text"] == ":rotating_light: Cluster teardown failed"
    assert teardown["text"].startswith("Cluster teardown failed: llm-pretrain")


def test_user_text_cannot_start_a_block_quote() -> None:
    """A '>' at the start of a line of user text (a reservation name, an agent's failure line) showed the rest as a
    Slack block quote: Slack quotes a line starting with '&gt;' just as with '>'. The '>' is now fenced off."""
    payload = {**RESERVATION, "name": "> shouting\n>>> all of it", "tenant_name": ">team", "actor": "bob\n> me",
               "cluster_id": 7}
    health = {**SAMPLES[Event.HEALTH_CHECK_FAILED], "name": ">x", "failures": ["GPU 1 down\n> see log", "> GPU 2"]}
    messages = [build_message(event, payload, BASE) for event in (Event.RESERVATION_CONFIRMED,
                                                                 Event.RESERVATION_CHANGED, Event.CLUSTER_READY)]
    messages.append(build_message(Event.HEALTH_CHECK_FAILED, health, BASE))
    for message in messages:
        for text in _all_texts(message):
            for line in text.split("\n"):
                assert not re.match(r"[ \t]*(&gt;|>)", line), (text, line)
    assert escape("> x") == f"{ZW}&gt; x"
    assert escape("a\n  >b") == f"a\n  {ZW}&gt;b"
    assert escape("a > b") == "a &gt; b"  # not at a line start: left alone
    assert slack.plain(escape(">>> all\n> of it")) == ">>> all\n> of it"


def test_a_renewed_kubeconfig_says_when_the_downloaded_one_stops_working() -> None:
    message = build_message(Event.CLUSTER_CREDENTIALS_RENEWED, SAMPLES[Event.CLUSTER_CREDENTIALS_RENEWED], BASE)
    body = "\n".join(_all_texts(message))
    old = START + timedelta(hours=1)
    assert "has a new kubeconfig" in body and "Download it again from the cluster page" in body
    assert f"<!date^{int(old.timestamp())}^" in body and "stops working" in body
    assert "*New kubeconfig expires*" in body and "2025-03-01T11:00:00Z" in body
    assert message["text"] == "New kubeconfig issued: llm-pretrain (Research &amp; Dev)"
    unknown = {k: v for k, v in SAMPLES[Event.CLUSTER_CREDENTIALS_RENEWED].items()
               if k not in ("expires_at", "previous_expires_at")}
    body = "\n".join(_all_texts(build_message(Event.CLUSTER_CREDENTIALS_RENEWED, unknown, BASE)))
    assert "may stop working" in body and "New kubeconfig expires" not in body
