"""Build Slack Block Kit messages for portal events.

``build_message(event, payload, base_url)`` returns ``{"text": ..., "blocks": [...]}``
ready to POST to an incoming webhook (``to_body`` gives the bytes). No Django here: the
caller turns its models into a plain payload dict of JSON-able values (datetimes may be
aware ``datetime`` objects or ISO 8601 strings with an offset).

Payload keys (only the ones an event needs are read; ``tenant`` is always required,
except for ``test``):

    tenant            tenant slug                 tenant_name   display name (optional)
    reservation_id    reservation primary key     name          reservation name (optional)
    pool              pool name                   node_count    int
    start, end        aware datetimes             nodes         list of hostnames (optional)
    billing           "committed" | "burst"       actor         username who did it (optional)
    previous_start, previous_end, previous_node_count           before a change (optional)
    cluster_id, orchestrator, cuda_version, access, phase       cluster events (optional)
    expires_at, previous_expires_at   the new and the replaced kubeconfig's token expiry (optional)
    node, replacement hostnames (node events)     reason        free text (optional)
    level, verdict, failures (list of str)        health-check events
    used_nodes, max_nodes, percent (optional)     quota events
    url               overrides the main portal link

Why the care with text: names and reasons are typed by users, and Slack parses ``<...>``
as links and mentions, so an unescaped reservation called ``<!channel>`` would page the
whole channel, and ``*urgent*`` would be bold. Everything user-supplied goes through ``escape`` (entities
for &<>, zero-width fences around *_~` and before a line-starting '>'; inside code spans only the entities)
and length limits are enforced here, because Slack rejects an oversized message outright (``invalid_blocks``)
instead of truncating it.
"""

from __future__ import annotations

import enum
import html
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = [
    "Event",
    "EVENTS",
    "build_message",
    "to_body",
    "escape",
    "plain",
    "fit",
    "link",
    "slack_date",
    "iso_utc",
    "validate_message",
    "PATHS",
]

# Slack Block Kit limits (docs.slack.dev/reference/block-kit/...).
MAX_BLOCKS = 50
MAX_SECTION_TEXT = 3000
MAX_FIELD_TEXT = 2000
MAX_FIELDS = 10
MAX_HEADER_TEXT = 150
MAX_CONTEXT_ELEMENTS = 10
# Slack truncates a message's text beyond 40,000 characters and recommends under 4,000;
# ours is a one-line summary (it is what phone notifications show), so keep it short.
MAX_FALLBACK_TEXT = 3000
# A reservation can hold hundreds of nodes; list a readable number and count the rest.
MAX_LISTED_NODES = 40
MAX_LISTED_FAILURES = 20
# User-supplied names (reservation, tenant, hostnames, actor) are clipped to this many
# characters before formatting, so one absurd name cannot push a section past its limit.
MAX_NAME = 200
# Free-text keys that keep their length here; their blocks fit them to the limit instead.
_LONG_TEXT_KEYS = frozenset({"reason", "access", "url"})

KNOWN_BLOCK_TYPES = frozenset({"header", "section", "context", "divider"})

# Portal pages the messages link to, relative to the base URL. Kept in one place so the
# HTML routes can change without hunting through the builders; ``payload["url"]`` wins.
PATHS = {
    "reservation": "/reservations/{reservation_id}/",
    "cluster": "/clusters/{cluster_id}/",
    "quota": "/reservations/",
    "home": "/",
}


class Event(enum.StrEnum):
    RESERVATION_CONFIRMED = "reservation.confirmed"
    RESERVATION_CHANGED = "reservation.changed"
    RESERVATION_CANCELLED = "reservation.cancelled"
    RESERVATION_STARTING_1H = "reservation.starting_1h"
    RESERVATION_ENDING_24H = "reservation.ending_24h"
    RESERVATION_ENDING_1H = "reservation.ending_1h"
    CLUSTER_READY = "cluster.ready"
    CLUSTER_FAILED = "cluster.failed"
    CLUSTER_DEGRADED = "cluster.degraded"
    CLUSTER_CREDENTIALS_RENEWED = "cluster.credentials_renewed"
    NODE_FAILED = "node.failed"
    NODE_REPLACED = "node.replaced"
    HEALTH_CHECK_FAILED = "health_check.failed"
    QUOTA_THRESHOLD = "quota.threshold"
    TEST = "test"


EVENTS = frozenset(Event)


# --- text primitives -------------------------------------------------------------------


# Slack's formatting marks (bold, italics, strike, code). Slack has no escape for them; a mark fenced by
# zero-width spaces on both sides is no longer at a word boundary, so Slack shows it as typed.
_MARKS = re.compile(r"[*_~`]")
_ZWSP = "\u200b"
# A line starting with '>' is a block quote, and Slack reads '&gt;' there just the same; a zero-width space
# before it means the line no longer starts with one. User text may be placed at a line start (a field's
# value, a line after one the user typed), so the start of every piece counts as one.
_QUOTE = re.compile(r"^([ \t]*)&gt;", re.MULTILINE)


def _entities(text: Any) -> str:
    """Escape &, < and > as Slack asks (inside code spans, where nothing else is parsed)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def escape(text: Any) -> str:
    """Return user text for mrkdwn, shown literally: no links, no @channel/@here/<@U…> mentions, no formatting.

    &, < and > become entities (Slack's documented escaping); *, _, ~ and ` are fenced by zero-width
    spaces so a reservation called ``*urgent*`` is not shown in bold, and a '>' starting a line gets one in
    front so it does not start a block quote. Every piece of user text in a message goes through here (code
    spans use ``_entities``: nothing is formatted inside them).
    """
    text = _MARKS.sub(lambda m: f"{_ZWSP}{m.group()}{_ZWSP}", _entities(text))
    return _QUOTE.sub(rf"\1{_ZWSP}&gt;", text)


def plain(text: str) -> str:
    """Undo ``escape``: the text as typed (for the delivery log's one line, which is no mrkdwn)."""
    return html.unescape(text.replace(_ZWSP, ""))


def fit(text: str, limit: int) -> str:
    """Shorten already-escaped mrkdwn text to at most limit characters, ending in '…'.

    Never cut inside an entity (``&amp;``) or a ``<...>`` token, which would leave Slack
    with a broken link or stray markup.
    """
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    amp = cut.rfind("&")
    if amp != -1 and ";" not in cut[amp:]:
        cut = cut[:amp]
    lt = cut.rfind("<")
    if lt != -1 and ">" not in cut[lt:]:
        cut = cut[:lt]
    return cut + "…"


def _clip(text: str, limit: int = MAX_NAME) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clip_value(value: Any) -> Any:
    if isinstance(value, str):
        return _clip(value)
    if isinstance(value, list | tuple):
        return [_clip(v) if isinstance(v, str) else v for v in value]
    return value


def _code(text: Any) -> str:
    # A backtick would end the code span early; hostnames and slugs never contain one.
    return "`" + _entities(text).replace("`", "'") + "`"


def _block_quote(text: str, limit: int) -> str:
    # A code block keeps error messages' formatting and stops mrkdwn (*_~) inside them.
    body = _entities(text).replace("```", "'''")
    return "```" + fit(body, limit - 6) + "```"


def link(url: str, label: str) -> str:
    """Return a mrkdwn link ``<url|label>``; label is user text and gets escaped."""
    # In the URL, '|' would end it early; escape &<> as Slack asks for all message text.
    safe_url = _entities(url.replace("|", "%7C"))
    return f"<{safe_url}|{escape(label).replace('|', '¦')}>"


def _as_datetime(value: Any, key: str) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"payload[{key!r}] is not an ISO 8601 datetime: {value!r}") from None
    if not isinstance(value, datetime):
        raise ValueError(f"payload[{key!r}] must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        # A naive time would be shown as UTC by accident; make the caller say what it means.
        raise ValueError(f"payload[{key!r}] must be timezone-aware")
    return value.astimezone(UTC)


def iso_utc(value: datetime | str) -> str:
    """Return value as ``YYYY-MM-DDTHH:MM:SSZ`` (UTC), the portal's wire format."""
    return _as_datetime(value, "datetime").strftime("%Y-%m-%dT%H:%M:%SZ")


def slack_date(value: datetime | str, fmt: str = "{date_short_pretty} {time}") -> str:
    """Return a ``<!date^…>`` token: each reader sees the time in their own time zone.

    Clients that cannot render it show the fallback, the UTC ISO time.
    """
    dt = _as_datetime(value, "datetime")
    return f"<!date^{int(dt.timestamp())}^{fmt}|{iso_utc(dt)}>"


def _when(value: Any, key: str) -> str:
    dt = _as_datetime(value, key)
    return f"{slack_date(dt)}\n{iso_utc(dt)}"


def _duration(start: datetime, end: datetime) -> str:
    minutes = int((end - start).total_seconds() // 60)
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    parts = [f"{days} d" if days else "", f"{hours} h" if hours else "", f"{mins} min" if mins else ""]
    return " ".join(p for p in parts if p) or "0 min"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _node_list(nodes: Sequence[Any], limit: int = MAX_SECTION_TEXT, title: str = "Nodes") -> str:
    shown = [_code(n) for n in nodes[:MAX_LISTED_NODES]]
    more = len(nodes) - len(shown)
    head = f"*{title} ({len(nodes)})*\n"
    text = head + ", ".join(shown) + (f" … and {more} more" if more else "")
    while len(text) > limit and shown:  # very long hostnames: drop names until it fits
        shown.pop()
        more += 1
        text = head + ", ".join(shown) + f" … and {more} more"
    return text


def _bullet_list(title: str, items: Sequence[str], max_items: int, limit: int = MAX_SECTION_TEXT) -> str:
    """Return "*title*" and one bullet per item, as many as fit, then "… and N more"."""
    text = f"*{title}*"
    for shown, item in enumerate(items[:max_items]):
        line = f"\n• {escape(item)}"
        rest = len(items) - shown
        # Keep room for the "… and N more" line whenever items remain after this one.
        reserve = len(f"\n… and {rest} more") if rest > 1 else 0
        if len(text) + len(line) + reserve > limit:
            return text + f"\n… and {rest} more"
        text += line
    if len(items) > max_items:
        text += f"\n… and {len(items) - max_items} more"
    return text


# --- block primitives ------------------------------------------------------------------


def _header(text: str) -> dict[str, Any]:
    return {"type": "header", "text": {"type": "plain_text", "text": fit(text, MAX_HEADER_TEXT), "emoji": True}}


def _mrkdwn(text: str, limit: int) -> dict[str, Any]:
    # verbatim: Slack leaves bare URLs and names in tenant text (an agent's failure line, a reservation
    # name) as typed instead of turning them into links; the portal's own links are explicit <url|label>.
    return {"type": "mrkdwn", "text": fit(text, limit), "verbatim": True}


def _section(text: str, fields: Iterable[str] = ()) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "section", "text": _mrkdwn(text, MAX_SECTION_TEXT)}
    field_list = [_mrkdwn(f, MAX_FIELD_TEXT) for f in fields][:MAX_FIELDS]
    if field_list:
        block["fields"] = field_list
    return block


def _context(*parts: str) -> dict[str, Any]:
    elements = [_mrkdwn(p, MAX_SECTION_TEXT) for p in parts if p]
    return {"type": "context", "elements": elements[:MAX_CONTEXT_ELEMENTS]}


def _field(label: str, value: str) -> str:
    return f"*{label}*\n{value}"


# --- payload access --------------------------------------------------------------------


class _Ctx:
    """One payload plus the base URL, with the lookups every builder needs."""

    def __init__(self, event: Event, payload: Mapping[str, Any], base_url: str) -> None:
        self.event = event
        self.p = {k: v if k in _LONG_TEXT_KEYS else _clip_value(v) for k, v in payload.items()}
        self.base_url = base_url.rstrip("/")

    def need(self, *keys: str) -> None:
        missing = [k for k in keys if self.p.get(k) in (None, "")]
        if missing:
            raise ValueError(f"{self.event}: payload is missing {', '.join(missing)}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.p.get(key)
        return default if value in (None, "") else value

    def url(self, page: str) -> str:
        if self.get("url"):
            return str(self.p["url"])
        values = {k: quote(str(self.get(k, "")), safe="") for k in ("reservation_id", "cluster_id")}
        return self.base_url + PATHS[page].format(**values)

    @property
    def tenant(self) -> str:
        return escape(self.get("tenant_name") or self.get("tenant", ""))

    @property
    def tenant_plain(self) -> str:
        return str(self.get("tenant_name") or self.get("tenant", ""))

    @property
    def reservation_label(self) -> str:
        return str(self.get("name") or f"Reservation #{self.get('reservation_id')}")

    def reservation_link(self) -> str:
        page = "reservation"
        if self.get("reservation_id") is None and not self.get("url"):
            return escape(self.reservation_label)
        return f"*{link(self.url(page), self.reservation_label)}*"

    def cluster_link(self) -> str:
        if self.get("cluster_id") is not None or self.get("url"):
            return f"*{link(self.url('cluster'), self.reservation_label)}*"
        return self.reservation_link()

    def start_end(self) -> tuple[datetime, datetime]:
        return _as_datetime(self.p["start"], "start"), _as_datetime(self.p["end"], "end")

    def footer(self) -> dict[str, Any]:
        parts = [link(self.base_url + PATHS["home"], "GPU Portal")]
        if self.get("tenant"):
            parts.append(f"tenant {_code(self.p['tenant'])}")
        parts.append(f"event {_code(self.event.value)}")
        return _context(" · ".join(parts))

    def reason_blocks(self, title: str = "Reason") -> list[dict[str, Any]]:
        if not self.get("reason"):
            return []
        head = f"*{title}*\n"
        return [_section(head + _block_quote(str(self.p["reason"]), MAX_SECTION_TEXT - len(head)))]

    def nodes_blocks(self, key: str = "nodes", title: str = "Nodes") -> list[dict[str, Any]]:
        nodes = self.get(key) or []
        return [_section(_node_list(list(nodes), title=title))] if nodes else []


class _Msg:
    """What a builder produces: the plain fallback text, header and body blocks."""

    def __init__(self, text: str, header: str, blocks: list[dict[str, Any]]) -> None:
        self.text, self.header, self.blocks = text, header, blocks


# --- builders --------------------------------------------------------------------------

_RESERVATION_KEYS = ("tenant", "reservation_id", "pool", "node_count", "start", "end")


def _reservation_fields(c: _Ctx, *, previous: bool = False) -> list[str]:
    start, end = c.start_end()
    node_count = int(c.p["node_count"])
    start_text, end_text, count_text = _when(start, "start"), _when(end, "end"), str(node_count)
    if previous:
        # Show what changed as "~old~ → new" so nobody has to remember the old window.
        if c.get("previous_start") and _as_datetime(c.p["previous_start"], "previous_start") != start:
            start_text = f"~{iso_utc(c.p['previous_start'])}~ →\n{start_text}"
        if c.get("previous_end") and _as_datetime(c.p["previous_end"], "previous_end") != end:
            end_text = f"~{iso_utc(c.p['previous_end'])}~ →\n{end_text}"
        if c.get("previous_node_count") is not None and int(c.p["previous_node_count"]) != node_count:
            count_text = f"~{int(c.p['previous_node_count'])}~ → {node_count}"
    fields = [
        _field("Pool", _code(c.p["pool"])),
        _field("Nodes", count_text),
        _field("Start", start_text),
        _field("End", end_text),
        _field("Duration", _duration(start, end)),
    ]
    if c.get("billing"):
        fields.append(_field("Billing", escape(c.p["billing"])))
    if c.get("orchestrator"):
        cluster = escape(c.p["orchestrator"])
        if c.get("cuda_version"):
            cluster += f", CUDA {escape(c.p['cuda_version'])}"
        fields.append(_field("Cluster", cluster))
    return fields


def _summary_text(c: _Ctx, what: str) -> str:
    start, end = c.start_end()
    return (
        f"{what}: {c.reservation_label} ({c.tenant_plain}), {c.p['node_count']} × {c.p['pool']}, "
        f"{iso_utc(start)} → {iso_utc(end)}"
    )


def _reservation_confirmed(c: _Ctx) -> _Msg:
    c.need(*_RESERVATION_KEYS)
    n = int(c.p["node_count"])
    lead = f"{c.reservation_link()} is booked for *{c.tenant}*: {_plural(n, 'node')} of {_code(c.p['pool'])}."
    if c.get("actor"):
        lead += f" Booked by {escape(c.p['actor'])}."
    blocks = [_section(lead, _reservation_fields(c)), *c.nodes_blocks()]
    return _Msg(_summary_text(c, "Reservation confirmed"), ":white_check_mark: Reservation confirmed", blocks)


def _reservation_changed(c: _Ctx) -> _Msg:
    c.need(*_RESERVATION_KEYS)
    lead = f"{c.reservation_link()} of *{c.tenant}* was changed"
    lead += f" by {escape(c.p['actor'])}." if c.get("actor") else "."
    blocks = [_section(lead, _reservation_fields(c, previous=True)), *c.nodes_blocks()]
    return _Msg(_summary_text(c, "Reservation changed"), ":pencil2: Reservation changed", blocks)


def _reservation_cancelled(c: _Ctx) -> _Msg:
    c.need(*_RESERVATION_KEYS)
    n = int(c.p["node_count"])
    lead = f"{c.reservation_link()} of *{c.tenant}* was cancelled"
    lead += f" by {escape(c.p['actor'])}." if c.get("actor") else "."
    lead += f" Its {_plural(n, 'node')} of {_code(c.p['pool'])} {'is' if n == 1 else 'are'} free again."
    blocks = [_section(lead, _reservation_fields(c)), *c.reason_blocks()]
    return _Msg(_summary_text(c, "Reservation cancelled"), ":x: Reservation cancelled", blocks)


def _reservation_starting(c: _Ctx) -> _Msg:
    c.need(*_RESERVATION_KEYS)
    start, _ = c.start_end()
    lead = (
        f"{c.reservation_link()} of *{c.tenant}* starts {slack_date(start, '{date_pretty} at {time}')} "
        f"(in about 1 hour). You will get another message when the cluster is ready."
    )
    blocks = [_section(lead, _reservation_fields(c)), *c.nodes_blocks()]
    return _Msg(_summary_text(c, "Reservation starts in 1 hour"), ":hourglass_flowing_sand: Starts in 1 hour", blocks)


def _reservation_ending(hours: int) -> Callable[[_Ctx], _Msg]:
    def build(c: _Ctx) -> _Msg:
        c.need(*_RESERVATION_KEYS)
        _, end = c.start_end()
        span = _plural(hours, "hour")
        lead = (
            f"{c.reservation_link()} of *{c.tenant}* ends {slack_date(end, '{date_pretty} at {time}')} "
            f"(in about {span}). Save your work: the nodes are wiped and returned at the end. "
            f"Extend the reservation on the portal if you need more time."
        )
        blocks = [_section(lead, _reservation_fields(c)), *c.nodes_blocks()]
        emoji = ":calendar:" if hours >= 24 else ":hourglass:"
        return _Msg(_summary_text(c, f"Reservation ends in {span}"), f"{emoji} Ends in {span}", blocks)

    return build


def _cluster_fields(c: _Ctx) -> list[str]:
    fields = []
    if c.get("orchestrator"):
        fields.append(_field("Orchestrator", escape(c.p["orchestrator"])))
    if c.get("cuda_version"):
        fields.append(_field("CUDA", escape(c.p["cuda_version"])))
    if c.get("pool"):
        fields.append(_field("Pool", _code(c.p["pool"])))
    if c.get("node_count") is not None:
        fields.append(_field("Nodes", str(int(c.p["node_count"]))))
    if c.get("end"):
        fields.append(_field("Ends", _when(c.p["end"], "end")))
    if c.get("phase"):
        fields.append(_field("Phase", _code(c.p["phase"])))
    return fields


def _cluster_ready(c: _Ctx) -> _Msg:
    c.need("tenant", "reservation_id")
    kind = f"{escape(c.p['orchestrator'])} cluster" if c.get("orchestrator") else "cluster"
    if c.get("recovered"):
        # Whole again after a degradation (a window change its backend refused, then took): nothing was built.
        lead = (
            f"The {kind} for {c.cluster_link()} of *{c.tenant}* is back to normal: its backend now holds the "
            f"booking's window, so jobs run until the end below. The cluster was not rebuilt; connect as before."
        )
        text = f"Cluster back to normal: {c.reservation_label} ({c.tenant_plain})"
        return _Msg(text, ":white_check_mark: Cluster back to normal", [_section(lead, _cluster_fields(c))])
    lead = f"The {kind} for {c.cluster_link()} of *{c.tenant}* is ready: health checks passed, go ahead."
    blocks = [_section(lead, _cluster_fields(c))]
    if c.get("access"):
        blocks.append(_section("*Access*\n" + _block_quote(str(c.p["access"]), MAX_SECTION_TEXT - 11)))
    blocks += c.nodes_blocks()
    text = f"Cluster ready: {c.reservation_label} ({c.tenant_plain})"
    return _Msg(text, ":rocket: Cluster ready", blocks)


def _cluster_failed(c: _Ctx) -> _Msg:
    c.need("tenant", "reservation_id")
    if c.get("phase") == "tearing_down":
        # The window is over: the nodes stay out of service until staff have the cluster torn down.
        lead = (
            f"Tearing down the cluster for {c.cluster_link()} of *{c.tenant}* failed after its window. "
            f"The platform team has the details and will clean it up; nothing is needed from you."
        )
        blocks = [_section(lead, _cluster_fields(c)), *c.reason_blocks()]
        text = f"Cluster teardown failed: {c.reservation_label} ({c.tenant_plain})"
        return _Msg(text, ":rotating_light: Cluster teardown failed", blocks)
    # A cluster that fails for good fails its booking, whose nodes go back to the pool (a staff retry books
    # them again when they are still free).
    lead = (
        f"Provisioning the cluster for {c.cluster_link()} of *{c.tenant}* failed, so the booking has failed "
        f"and its nodes were released. The platform team has the details and can retry it."
    )
    blocks = [_section(lead, _cluster_fields(c)), *c.reason_blocks()]
    text = f"Cluster failed: {c.reservation_label} ({c.tenant_plain})"
    return _Msg(text, ":rotating_light: Cluster provisioning failed", blocks)


def _cluster_degraded(c: _Ctx) -> _Msg:
    c.need("tenant", "reservation_id")
    if c.get("nodes") or not c.get("reason"):
        lead = (
            f"The cluster for {c.cluster_link()} of *{c.tenant}* is running degraded: "
            f"some nodes are unhealthy and no spare was free to replace them."
        )
    else:  # not a node (a window change the backend refused): the reason says what and what to do
        lead = f"The cluster for {c.cluster_link()} of *{c.tenant}* is running degraded; the reason says why."
    blocks = [
        _section(lead, _cluster_fields(c)),
        *c.nodes_blocks(title="Affected nodes"),
        *c.reason_blocks(),
    ]
    text = f"Cluster degraded: {c.reservation_label} ({c.tenant_plain})"
    return _Msg(text, ":warning: Cluster degraded", blocks)


def _cluster_credentials_renewed(c: _Ctx) -> _Msg:
    c.need("tenant", "reservation_id")
    lead = (
        f"The cluster for {c.cluster_link()} of *{c.tenant}* has a new kubeconfig. "
        f"Download it again from the cluster page: the one downloaded before "
    )
    if c.get("previous_expires_at"):
        lead += f"stops working {slack_date(c.p['previous_expires_at'], '{date_pretty} at {time}')} at the latest."
    else:
        lead += "may stop working at any time."
    fields = _cluster_fields(c)
    if c.get("expires_at"):
        fields.insert(0, _field("New kubeconfig expires", _when(c.p["expires_at"], "expires_at")))
    blocks = [_section(lead, fields[:MAX_FIELDS])]
    text = f"New kubeconfig issued: {c.reservation_label} ({c.tenant_plain})"
    return _Msg(text, ":key: New kubeconfig issued", blocks)


def _node_failed(c: _Ctx) -> _Msg:
    c.need("tenant", "node")
    where = f" of {c.cluster_link()}" if c.get("reservation_id") is not None else ""
    lead = f"Node {_code(c.p['node'])}{where} (*{c.tenant}*) failed and was taken out of service."
    blocks = [_section(lead, _cluster_fields(c)), *c.reason_blocks()]
    text = f"Node failed: {c.p['node']} ({c.tenant_plain})"
    return _Msg(text, ":red_circle: Node failed", blocks)


def _node_replaced(c: _Ctx) -> _Msg:
    c.need("tenant", "node", "replacement")
    where = f" of {c.cluster_link()}" if c.get("reservation_id") is not None else ""
    lead = (
        f"Node {_code(c.p['node'])}{where} (*{c.tenant}*) failed and was replaced by "
        f"{_code(c.p['replacement'])} for the rest of the reservation."
    )
    blocks = [_section(lead, _cluster_fields(c)), *c.reason_blocks()]
    text = f"Node replaced: {c.p['node']} → {c.p['replacement']} ({c.tenant_plain})"
    return _Msg(text, ":arrows_counterclockwise: Node replaced", blocks)


def _health_check_failed(c: _Ctx) -> _Msg:
    c.need("tenant", "node")
    level = f"*{escape(c.p['level'])}* " if c.get("level") else ""
    verdict = escape(c.get("verdict", "fail"))
    where = f" of {c.cluster_link()}" if c.get("reservation_id") is not None else ""
    lead = f"A {level}health check on node {_code(c.p['node'])}{where} (*{c.tenant}*) ended *{verdict}*."
    blocks = [_section(lead, _cluster_fields(c))]
    failures = [str(f) for f in (c.get("failures") or [])]
    if failures:
        blocks.append(_section(_bullet_list("Failures", failures, MAX_LISTED_FAILURES)))
    blocks += c.reason_blocks("Details")
    text = f"Health check failed: {c.p['node']} ({c.tenant_plain})"
    return _Msg(text, ":stethoscope: Health check failed", blocks)


def _quota_threshold(c: _Ctx) -> _Msg:
    c.need("tenant", "pool", "used_nodes", "max_nodes")
    used, limit = int(c.p["used_nodes"]), int(c.p["max_nodes"])
    if c.get("percent") is not None:
        percent = round(float(c.p["percent"]))
    else:
        percent = round(100 * used / limit) if limit else 100
    lead = (
        f"*{c.tenant}* has booked {used} of its {_plural(limit, 'guaranteed node')} in pool "
        f"{_code(c.p['pool'])} ({percent} %)."
    )
    if c.get("start") and c.get("end"):
        start, end = c.start_end()
        lead += f" Peak between {slack_date(start)} and {slack_date(end)}."
    lead += f" Bookings beyond the quota are refused or billed as burst. {link(c.url('quota'), 'See bookings')}"
    text = f"Quota {percent} % used: {c.tenant_plain}, pool {c.p['pool']} ({used} of {_plural(limit, 'node')})"
    return _Msg(text, f":bar_chart: Quota {percent} % used", [_section(lead)])


def _test(c: _Ctx) -> _Msg:
    who = f" (sent by {escape(c.p['actor'])})" if c.get("actor") else ""
    target = f" for *{c.tenant}*" if c.get("tenant") else ""
    lead = (
        f"This is a test message from {link(c.url('home'), 'GPU Portal')}{target}{who}. "
        f"If you can read it, notifications reach this channel."
    )
    text = "Test message from GPU Portal" + (f" for {c.tenant_plain}" if c.get("tenant") else "")
    return _Msg(text, ":wave: Test message from GPU Portal", [_section(lead)])


_BUILDERS: dict[Event, Callable[[_Ctx], _Msg]] = {
    Event.RESERVATION_CONFIRMED: _reservation_confirmed,
    Event.RESERVATION_CHANGED: _reservation_changed,
    Event.RESERVATION_CANCELLED: _reservation_cancelled,
    Event.RESERVATION_STARTING_1H: _reservation_starting,
    Event.RESERVATION_ENDING_24H: _reservation_ending(24),
    Event.RESERVATION_ENDING_1H: _reservation_ending(1),
    Event.CLUSTER_READY: _cluster_ready,
    Event.CLUSTER_FAILED: _cluster_failed,
    Event.CLUSTER_DEGRADED: _cluster_degraded,
    Event.CLUSTER_CREDENTIALS_RENEWED: _cluster_credentials_renewed,
    Event.NODE_FAILED: _node_failed,
    Event.NODE_REPLACED: _node_replaced,
    Event.HEALTH_CHECK_FAILED: _health_check_failed,
    Event.QUOTA_THRESHOLD: _quota_threshold,
    Event.TEST: _test,
}


# --- public entry points ---------------------------------------------------------------


def build_message(event: str, payload: Mapping[str, Any], base_url: str) -> dict[str, Any]:
    """Return the Slack message ``{"text", "blocks"}`` for event.

    Raise ValueError for an unknown event, a payload missing a required key, a naive
    datetime, or a base_url that is not an absolute http(s) URL.
    """
    try:
        kind = Event(event)
    except ValueError:
        raise ValueError(f"unknown notification event {event!r}") from None
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base_url must be an absolute http(s) URL, got {base_url!r}")
    ctx = _Ctx(kind, payload, base_url)
    msg = _BUILDERS[kind](ctx)
    blocks = [_header(msg.header), *msg.blocks, ctx.footer()]
    if len(blocks) > MAX_BLOCKS:  # not reachable with today's builders; keep the footer
        blocks = [*blocks[: MAX_BLOCKS - 1], blocks[-1]]
    message = {"text": fit(escape(msg.text), MAX_FALLBACK_TEXT), "blocks": blocks}
    problems = validate_message(message)
    if problems:  # a bug in a builder, not bad input: fail here rather than at Slack
        raise RuntimeError(f"{event}: built an invalid Slack message: {problems}")
    return message


def to_body(message: Mapping[str, Any]) -> bytes:
    """Return message as the compact UTF-8 JSON body to POST."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def validate_message(message: Mapping[str, Any]) -> list[str]:
    """Return the ways message breaks Slack's limits or our block vocabulary ([] if none)."""
    problems: list[str] = []
    text = message.get("text")
    if not isinstance(text, str) or not text.strip():
        problems.append("text fallback is empty")
    elif len(text) > MAX_FALLBACK_TEXT:
        problems.append(f"text is {len(text)} characters (max {MAX_FALLBACK_TEXT})")
    blocks = message.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        return [*problems, "blocks missing"]
    if len(blocks) > MAX_BLOCKS:
        problems.append(f"{len(blocks)} blocks (max {MAX_BLOCKS})")

    def check_text(obj: Any, where: str, limit: int, kinds: tuple[str, ...] = ("mrkdwn", "plain_text")) -> None:
        if not isinstance(obj, Mapping) or obj.get("type") not in kinds:
            problems.append(f"{where}: text object must be one of {kinds}")
            return
        value = obj.get("text")
        if not isinstance(value, str) or not value:
            problems.append(f"{where}: empty text")
        elif len(value) > limit:
            problems.append(f"{where}: {len(value)} characters (max {limit})")

    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        where = f"blocks[{i}] ({kind})"
        if kind not in KNOWN_BLOCK_TYPES:
            problems.append(f"{where}: unknown block type")
        elif kind == "header":
            check_text(block.get("text"), where, MAX_HEADER_TEXT, ("plain_text",))
        elif kind == "section":
            if "text" not in block and "fields" not in block:
                problems.append(f"{where}: needs text or fields")
            if "text" in block:
                check_text(block["text"], where, MAX_SECTION_TEXT)
            fields = block.get("fields", [])
            if len(fields) > MAX_FIELDS:
                problems.append(f"{where}: {len(fields)} fields (max {MAX_FIELDS})")
            for j, f in enumerate(fields):
                check_text(f, f"{where}.fields[{j}]", MAX_FIELD_TEXT)
        elif kind == "context":
            elements = block.get("elements") or []
            if not elements or len(elements) > MAX_CONTEXT_ELEMENTS:
                problems.append(f"{where}: {len(elements)} elements (1..{MAX_CONTEXT_ELEMENTS})")
            for j, e in enumerate(elements):
                check_text(e, f"{where}.elements[{j}]", MAX_SECTION_TEXT)
    return problems
