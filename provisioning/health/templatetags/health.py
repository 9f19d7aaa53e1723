"""Health on any page: ``{% load health %}``.

- ``{% health_badge value %}``: a verdict as a badge. Pass a HealthCheck or a verdict string the reader
  may see, or a node annotated by ``selectors.nodes_with_health`` (staff pages). A plain node is refused
  (TypeError): the tag cannot know whose checks the reader may see, so it never looks one up itself.
- ``{{ step.at|stored_time }}``: an ISO timestamp kept in JSON (a repair's steps) as a time in the
  reader's zone, like the page's other times.
- ``{% cluster_health cluster %}``: the per-GPU results of the cluster's nodes as the signed-in
  user may see them, with a link to the cluster's health page (``templates/health/_results.html``).
"""

from __future__ import annotations

from typing import Any

from django import template
from django.utils import timezone

from ..models import HealthCheck

register = template.Library()


@register.filter
def stored_time(value: Any, fmt: str = "Y-m-d H:i:s T") -> Any:
    """An ISO-8601 string with an offset (as JSON keeps times) written in the current zone, in the date
    filter's format; anything unreadable (or without an offset) is shown as it is."""
    from datetime import datetime

    from django.utils.dateformat import format as date_format

    try:
        moment = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return value
    return date_format(timezone.localtime(moment), fmt) if timezone.is_aware(moment) else value

# Badge colours (background, text) per verdict, matching the portal's status badges.
VERDICT_COLOURS: dict[str, tuple[str, str]] = {
    "pass": ("#d4f0dc", "#14532d"),
    "warn": ("#fdebd0", "#7a4100"),
    "unknown": ("#e6e8eb", "#3f4753"),
    "fail": ("#fde2e0", "#8a1c13"),
    "running": ("#dbe8fb", "#18427a"),
    "none": ("#f1f3f6", "#5b6677"),
}


def _badge_context(verdict: str | None, *, title: str = "", check_id: int | None = None,
                   running: bool = False) -> dict[str, Any]:
    key = verdict or ("running" if running else "none")
    background, colour = VERDICT_COLOURS.get(key, VERDICT_COLOURS["none"])
    label = {"none": "not checked", "running": "checking…"}.get(key, key)
    return {"verdict": key, "label": label, "title": title, "check_id": check_id,
            "style": f"background:{background};color:{colour}", "running": running and bool(verdict)}


def _local(when) -> str:
    """An instant in the reader's zone (the page's), as the rest of the page gives its times."""
    local = timezone.localtime(when)
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()}"


@register.inclusion_tag("health/_badge.html")
def health_badge(value: Any) -> dict[str, Any]:
    """Render a verdict badge for a check, a verdict string or an annotated node; refuse anything else."""
    if value is None or isinstance(value, str):
        return _badge_context(value or None)
    if isinstance(value, HealthCheck):
        if value.is_open:
            return _badge_context(None, running=True, title=f"{value.level} check {value.status}")
        return _badge_context(value.verdict, title=value.summary, check_id=value.pk)
    if hasattr(value, "health_verdict"):  # annotated by selectors.nodes_with_health
        when = getattr(value, "health_checked_at", None)
        title = (value.health_summary or "") + (f" · {_local(when)}" if when else "")
        return _badge_context(value.health_verdict, title=title, check_id=value.health_check_id,
                              running=bool(getattr(value, "health_running", False)))
    # A plain node (or anything else): looking up its newest check here would show it to whoever reads
    # the page, another tenant included. The view decides what the reader may see and passes that.
    raise TypeError(
        f"health_badge takes a HealthCheck, a verdict string or a node annotated by "
        f"selectors.nodes_with_health, not {type(value).__name__}"
    )


@register.filter
def verdict_style(verdict: str | None) -> str:
    """Return the inline style of a verdict badge (for hand-made badges)."""
    return _badge_context(verdict or None)["style"]


@register.inclusion_tag("health/_results.html", takes_context=True)
def cluster_health(context: template.Context, cluster: Any) -> dict[str, Any]:
    """Render the newest per-GPU results of the cluster's nodes for the signed-in user."""
    from ..selectors import can_request_cluster_checks
    from ..selectors import cluster_health as rows_for

    request = context.get("request")
    user = getattr(request, "user", None)
    rows = rows_for(cluster, user=user) if user is not None else []
    return {
        "rows": rows,
        "cluster": cluster,
        "can_request": can_request_cluster_checks(user, cluster) if user is not None else False,
        "request": request,
        "compact": True,
        "polling": any(row["open"] for row in rows),
    }
