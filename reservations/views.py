"""Browser pages: dashboard, calendar and its JSON feeds, booking with a live preview, the
reservation page, the pool heatmap, the staff fleet timeline and the iCalendar feed.

Views parse input, call a service or a selector and render; the rules live in services.
Every read goes through the tenant scope (`for_user`, or `for_tenant` behind the feed's token).
"""

from __future__ import annotations

import bisect
import re
import zlib
from datetime import UTC, date, datetime, timedelta
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Prefetch
from django.http import Http404, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.loader import select_template
from django.urls import reverse
from django.utils import timezone
from django.utils.crypto import salted_hmac
from django.utils.formats import date_format
from django.views.decorators.cache import add_never_cache_headers
from django.views.decorators.http import require_GET, require_http_methods, require_POST, require_safe
from django.views.decorators.vary import vary_on_headers
from django_htmx.http import trigger_client_event

from portal.core.exceptions import Busy, CapacityUnavailable, DomainError, InvalidInput
from portal.core.fields import DATETIME_MAX, DATETIME_MIN
from portal.core.timefmt import format_utc
from portal.core.views import page_query
from portal.core.words import count_of
from tenants.models import Membership, Quota, Tenant
from tenants.selectors import ical_feed_tenant, ical_feed_token
from tenants.views import portal_json, portal_view, render_page, stops_polling_when_gone

from . import selectors, services
from .choices import FINAL_STATUSES, NodeState, ReservationStatus
from .forms import BookingForm, CalendarWindowForm, ExtendForm, FleetWindowForm, RenameForm, ReservationListForm
from .ical import build_feed
from .models import Allocation, Pool
from .timeutil import is_aligned, slot_ceil

__all__ = [
    "dashboard",
    "calendar",
    "calendar_events",
    "calendar_availability",
    "booking_form",
    "booking_preview",
    "reservation_list",
    "reservation_detail",
    "reservation_panel",
    "reservation_extend",
    "reservation_cancel",
    "heatmap",
    "heatmap_grid",
    "fleet",
    "ical_feed",
]

CALENDAR_VIEWS = ("dayGridMonth", "timeGridWeek", "timeGridDay")
# The days the calendar opens on: its feeds take 1970 to 8999 (portal.core.fields), and a month view
# around the day (up to six weeks, any UTC offset) must lie inside. Another ?date= opens on today.
CALENDAR_FIRST_DAY = DATETIME_MIN.date() + CalendarWindowForm.MAX_SPAN + timedelta(days=1)
CALENDAR_LAST_DAY = DATETIME_MAX.date() - CalendarWindowForm.MAX_SPAN - timedelta(days=2)
HEATMAP_DAYS = 14
HEATMAP_REFRESH_SECONDS = 30
FEED_HISTORY = timedelta(days=30)
FLEET_PAGE_SIZE = 100
# Hooks for later work (virtual clusters, credentials, health): the first template that exists wins.
CLUSTER_TEMPLATES = ["provisioning/_reservation_cluster.html", "reservations/_cluster_placeholder.html"]
# The reservation page's poll of its cluster card (only a cluster's card polls: without provisioning, nothing does).
# While the cluster comes up it polls every 3 s; once the booking is under way (Active) nothing follows its status
# for a while, but a node can still fail and be swapped for a spare: the card goes on polling, this much slower, for
# the Nodes card and the timeline (sent only when they changed), until the booking is no longer active.
ACTIVE_POLL_SECONDS = 15
CLUSTER_POLL_TEMPLATES = ["provisioning/_reservation_cluster_poll.html", "reservations/_cluster_placeholder.html"]
# The calendar's side panel polls the booking it shows (its status, nodes and cluster) as the page does: every 3 s
# while it moves on quickly (booked, provisioning, ending), every ACTIVE_POLL_SECONDS while under way, never once over.
PANEL_POLL_SECONDS = 3
# What a panel's poll says it shows (_fingerprint's digests); an answer names the actions it replaces by theirs.
PANEL_MARK = re.compile(r"[0-9a-f]{8}")
CLUSTER_BADGE_TEMPLATES = ["provisioning/_cluster_badge.html", "reservations/_cluster_badge_placeholder.html"]


def _is_partial(request) -> bool:
    return bool(getattr(request, "htmx", False)) and not request.htmx.boosted


def _on_booking_page(request) -> bool:
    """The booking form is its page's main content (its heading the page's h1), not the calendar's side panel:
    the page itself, or htmx swapping an answer into that page."""
    if not _is_partial(request):
        return True
    return (request.htmx.current_url_abs_path or "").split("?")[0] == reverse("booking-form")


def _refusal(exc: DomainError) -> str:
    """A service's refusal as this page says it: a capacity shortfall's window in the reader's zone."""
    shortfall = getattr(exc, "shortfall", None)
    if shortfall:
        return services.capacity_text(**shortfall, tz=timezone.get_current_timezone())
    return exc.detail


def _envelope(code: str, detail: str, fields: dict | None = None, status: int = 400) -> JsonResponse:
    return JsonResponse({"code": code, "detail": detail, "fields": fields or {}}, status=status)


def _busy_answer(response, exc: DomainError | None):
    """A page answering Busy's 503 says when to send it again, as the API and BusyPageMiddleware do."""
    if isinstance(exc, Busy):
        response["Retry-After"] = str(exc.retry_after)
    return response


def _form_errors(form) -> JsonResponse:
    fields = {k: " ".join(v) for k, v in form.errors.items()}
    first = next(iter(fields.items()))
    return _envelope("invalid", f"{first[0]}: {first[1]}", fields)


def _own_reservations(request):
    active = Prefetch("allocations", queryset=Allocation.objects.filter(active=True).select_related("node"),
                      to_attr="active_allocations")
    return selectors.reservations_for_user(user=request.user).prefetch_related(active)


def _require_booking(request) -> None:
    if not request.portal.can_book:
        raise PermissionDenied("Your role does not allow booking.")


# --- dashboard --------------------------------------------------------------------------------


@require_safe
@portal_view
def dashboard(request):
    portal = request.portal
    context: dict = {"cluster_badge_template": select_template(CLUSTER_BADGE_TEMPLATES).template.name}
    if portal.tenant is not None:
        now = timezone.now()
        context.update(
            now=now,
            upcoming=list(_with_cluster(
                selectors.reservations_for_user(user=request.user).for_tenant(portal.tenant).holding()
                .filter(period__endswith__gt=now).order_by("period", "id")
            )[:20]),
            usage=selectors.tenant_quota_usage(tenant=portal.tenant, now=now, days=HEATMAP_DAYS),
            activity=list(selectors.tenant_recent_activity(tenant=portal.tenant, limit=10)),
            feed_url=_feed_url(request, portal.tenant),
        )
    response = render_page(request, "reservations/dashboard.html", context)
    if context.get("feed_url"):
        # The feed address opens the calendar without signing in: no cache (browser, proxy) keeps a copy.
        add_never_cache_headers(response)
    return response


def _with_cluster(qs):
    """Read each row's cluster in the same query when an app adds one (the badge then needs none).

    By the relation's name only: this app does not import the one that provides it."""
    if any(rel.name == "cluster" and rel.one_to_one for rel in qs.model._meta.related_objects):
        return qs.select_related("cluster")
    return qs


def _feed_url(request, tenant: Tenant) -> str | None:
    """The viewer's own feed address for the tenant (none for staff who are not members)."""
    membership_id = (Membership.objects.filter(tenant=tenant, user=request.user).values_list("pk", flat=True)
                     .first())
    token = ical_feed_token(tenant=tenant, membership_id=membership_id) if membership_id else None
    return request.build_absolute_uri(reverse("ical-feed", args=[tenant.slug, token])) if token else None


# --- calendar ---------------------------------------------------------------------------------


def _pick_pool(request, pools: list[Pool]) -> Pool | None:
    wanted = request.GET.get("pool")
    by_name = {p.name: p for p in pools}
    if wanted in by_name:
        return by_name[wanted]
    tenant = request.portal.tenant
    if tenant is not None:
        quota_pool = (Quota.objects.for_user(request.user).filter(tenant=tenant).order_by("pool__name")
                      .values_list("pool__name", flat=True).first())
        if quota_pool in by_name:
            return by_name[quota_pool]
    return pools[0] if pools else None


def _utc_offset_minutes(tz, day: str | None) -> int:
    on = date.fromisoformat(day) if day else timezone.localdate(timezone.now(), tz)
    noon = datetime.combine(on, datetime.min.time(), tzinfo=tz).replace(hour=12)
    return int(noon.utcoffset().total_seconds() // 60)


@require_safe
@portal_view
def calendar(request):
    portal = request.portal
    pools = list(Pool.objects.order_by("name"))
    pool = _pick_pool(request, pools)
    view = request.GET.get("view") if request.GET.get("view") in CALENDAR_VIEWS else None
    raw_date = request.GET.get("date", "").strip()
    try:
        asked = date.fromisoformat(raw_date)
    except ValueError:
        asked = None
    out_of_range = asked is not None and not CALENDAR_FIRST_DAY <= asked <= CALENDAR_LAST_DAY
    initial_date = asked.isoformat() if asked is not None and not out_of_range else None
    config = {
        "tz": portal.tz_name,
        "pool": pool.name if pool else None,
        "slotMinutes": pool.slot_minutes if pool else 60,
        "poolSlots": {p.name: p.slot_minutes for p in pools},
        # The zone's UTC offset on the shown day: the calendar lays its slots on the pool's grid, which
        # runs from the UTC epoch (in +05:30 an hourly pool's slots start at :30 local time).
        "utcOffsetMinutes": _utc_offset_minutes(portal.tz, initial_date),
        "canBook": portal.can_book,
        "tenant": portal.tenant.slug if portal.tenant else None,
        "initialView": view,
        "initialDate": initial_date,
        # Paging stops at the days it opens on (end exclusive): past them its feeds refuse the range.
        "validRange": {"start": CALENDAR_FIRST_DAY.isoformat(),
                       "end": (CALENDAR_LAST_DAY + timedelta(days=1)).isoformat()},
        "showAll": request.GET.get("all") == "1",  # month cells list every event instead of "+N more"
        "eventsUrl": reverse("calendar-events"),
        "availabilityUrl": reverse("calendar-availability"),
        "formUrl": reverse("booking-form"),
        "panelUrl": reverse("reservation-panel", args=[0]),
        "apiUrl": reverse("reservation-detail", args=[0]),  # the REST API: drag and resize PATCH it
    }
    note = ""
    if out_of_range:
        note = (f"There is no calendar for {asked.isoformat()} (it runs from {CALENDAR_FIRST_DAY:%Y} to "
                f"{CALENDAR_LAST_DAY:%Y}): showing today.")
    elif raw_date and asked is None:  # 2026-02-30, a typo: said, not silently replaced by today
        shown = raw_date if len(raw_date) <= 40 else raw_date[:40] + "…"
        note = f"There is no day {shown} (dates are written YYYY-MM-DD): showing today."
    return render_page(request, "reservations/calendar.html",
                       {"pools": pools, "pool": pool, "config": config, "date_note": note,
                        "booking_horizon_days": settings.PORTAL_BOOKING_HORIZON_DAYS})


EVENT_FIELDS = ("pk", "name", "node_count", "pool__name", "period", "status", "billing", "created_by_id")


def _event(row: tuple, *, portal, now: datetime, detail_url: str) -> dict:
    """One FullCalendar event, kept small: a month can hold a thousand of them."""
    pk, name, node_count, pool_name, period, status, billing, created_by_id = row
    event = {
        "id": str(pk),
        "title": f"{name or 'Reservation'} · {node_count}× {pool_name}",
        "start": format_utc(period.lower),
        "end": format_utc(period.upper),
        "url": detail_url.replace("/0/", f"/{pk}/"),
        "classNames": [f"st-{status}", f"bill-{billing}"],
        # Said in words too (the tooltip and accessible name), not only by the event's colour (WCAG 1.4.1).
        "status": ReservationStatus(status).label,
    }
    # Not editable unless said so (the calendar's default); the server still decides on every change.
    # An ending booking (its cluster torn down early) keeps its window: the service refuses any change.
    if (portal.can_book and portal.may_change(created_by_id=created_by_id)
            and status not in FINAL_STATUSES and status != ReservationStatus.ENDING and period.upper > now):
        event["editable"] = True
        # A running (or provisioning) booking can only be extended or shortened.
        event["startEditable"] = period.lower > now and status == ReservationStatus.CONFIRMED
        event["durationEditable"] = True
    return event


@require_GET
@portal_json
def calendar_events(request):
    """FullCalendar's event feed: the current tenant's reservations in [start, end). Constant queries."""
    form = CalendarWindowForm(request.GET)
    if not form.is_valid():
        return _form_errors(form)
    portal = request.portal
    if portal.tenant is None:
        return JsonResponse([], safe=False)
    data = form.cleaned_data
    now = timezone.now()
    detail_url = reverse("reservation-page", args=[0])
    rows = selectors.reservations_in_window(
        user=request.user, tenant=portal.tenant, start=data["start"], end=data["end"], pool=data.get("pool")
    ).values_list(*EVENT_FIELDS)
    return JsonResponse([_event(row, portal=portal, now=now, detail_url=detail_url) for row in rows], safe=False)


def _level(free: int, total: int) -> int:
    return 0 if total <= 0 or free <= 0 else max(1, min(4, round(4 * free / total)))


def _background(start, end, free: int, total: int, *, all_day: bool = False) -> dict:
    return {
        "start": start.isoformat() if all_day else format_utc(start),
        "end": end.isoformat() if all_day else format_utc(end),
        "allDay": all_day,
        "display": "background",
        "title": f"{free}/{total}",
        "classNames": ["free", f"free-l{_level(free, total)}"],
        "extendedProps": {"free": free, "total": total, "availability": True},
    }


def not_bookable_hint(reason: str) -> str:
    """Why time outside services.bookable_span cannot be booked (reason "past" or "horizon"): the calendar's
    and the heatmap's tooltip."""
    if reason == "past":
        return "Not bookable: this time is past; a booking starts at the slot running now at the earliest."
    return f"Not bookable yet: beyond the booking horizon of {count_of(settings.PORTAL_BOOKING_HORIZON_DAYS, 'day')}."


def _not_bookable(start, end, reason: str, total: int, *, all_day: bool = False) -> dict:
    """Shading for time no booking may take now (before the slot running now, or past the horizon): no free
    nodes to book, its own class, and a hint for its tooltip."""
    hint = not_bookable_hint(reason)
    return {
        "start": start.isoformat() if all_day else format_utc(start),
        "end": end.isoformat() if all_day else format_utc(end),
        "allDay": all_day,
        "display": "background",
        "title": "past" if reason == "past" else "not bookable yet",
        "classNames": ["free", "not-bookable", f"not-bookable-{reason}"],
        "extendedProps": {"free": 0, "total": total, "availability": True, "bookable": False, "reason": reason,
                          "hint": hint},
    }


def _bookable_parts(slots, earliest: datetime, latest: datetime):
    """Each slot cut at the bookable span's bounds: (start, end, free nodes or None, reason when not bookable)."""
    for slot in slots:
        for lo, hi, reason in ((slot.start, min(slot.end, earliest), "past"),
                               (max(slot.start, earliest), min(slot.end, latest), None),
                               (max(slot.start, latest), slot.end, "horizon")):
            if lo < hi:
                yield lo, hi, (slot.free_nodes if reason is None else None), reason


@require_GET
@portal_json
def calendar_availability(request):
    """Free nodes of one pool as background events: runs of equal free slots, or per local day. Constant queries."""
    form = CalendarWindowForm(request.GET)
    if not form.is_valid():
        return _form_errors(form)
    data = form.cleaned_data
    pool = data.get("pool")
    if pool is None:
        return _envelope("invalid", "pool: This field is required.", {"pool": "This field is required."})
    total = pool.nodes.filter(state=NodeState.AVAILABLE).count()
    start, end = data["start"], data["end"]
    # The pool's own slots (its grid from the UTC epoch), whatever local midnight the calendar starts at.
    slots = selectors.availability_on_grid(pool=pool, start=start, end=end)
    # Outside what the service lets a booking take now (the past, beyond the horizon) nothing is free to book.
    earliest, latest = services.bookable_span(pool=pool, now=timezone.now())
    parts = _bookable_parts(slots, earliest, latest)
    if data.get("granularity") == "day":
        tz = timezone.get_current_timezone()
        first, last = timezone.localdate(start, tz), timezone.localdate(end - timedelta(microseconds=1), tz)
        per_day: dict[date, int] = {}
        closed: dict[date, str] = {}  # days without a bookable slot: why
        for lo, hi, free, reason in parts:  # every local day a slot touches (a daily slot spans two outside UTC)
            day = max(timezone.localdate(lo, tz), first)
            while day <= min(timezone.localdate(hi - timedelta(microseconds=1), tz), last):
                if free is None:
                    closed.setdefault(day, reason)
                else:
                    per_day[day] = min(per_day.get(day, total), free)
                day += timedelta(days=1)
        events = [_background(day, day + timedelta(days=1), per_day[day], total, all_day=True) if day in per_day
                  else _not_bookable(day, day + timedelta(days=1), closed[day], total, all_day=True)
                  for day in sorted(per_day.keys() | closed.keys())]
        return JsonResponse(events, safe=False)
    events: list[dict] = []
    run: list | None = None  # [start, end, free, reason]
    for lo, hi, free, reason in parts:
        if run is not None and run[1] == lo and (run[2], run[3]) == (free, reason):
            run[1] = hi
            continue
        if run is not None:
            events.append(_run_event(run, total))
        run = [lo, hi, free, reason]
    if run is not None:
        events.append(_run_event(run, total))
    return JsonResponse(events, safe=False)


def _run_event(run: list, total: int) -> dict:
    start, end, free, reason = run
    return _background(start, end, free, total) if reason is None else _not_bookable(start, end, reason, total)


# --- booking ----------------------------------------------------------------------------------


def _suggestions(raw: list[dict]) -> list[dict]:
    out = []
    for s in raw:
        out.append({"start": s["start"], "end": s["end"],
                    "start_dt": datetime.fromisoformat(s["start"]), "end_dt": datetime.fromisoformat(s["end"])})
    return out


def _default_window(pool: Pool | None) -> tuple[datetime, datetime]:
    """About four hours from the next slot on, on the pool's grid (whole slots of any length)."""
    minutes = pool.slot_minutes if pool else 60
    start = slot_ceil(timezone.now(), minutes) + timedelta(minutes=minutes)
    return start, start + timedelta(minutes=minutes * max(1, round(240 / minutes)))


@require_http_methods(["GET", "POST"])
@vary_on_headers("HX-Request")  # the page, or the calendar panel's fragment, at one URL
@portal_view
def booking_form(request):
    """GET: the booking form (prefilled from a calendar selection). POST: book through the service."""
    portal = request.portal
    _require_booking(request)
    suggestions: list[dict] = []
    notice = ""
    status = 200
    refusal: DomainError | None = None
    if request.method == "POST":
        form = BookingForm(request.POST, user=request.user, tenant=portal.tenant)
        if form.is_valid():
            d = form.cleaned_data
            try:
                reservation = services.reservation_create(
                    actor=request.user, tenant=d["tenant"], pool=d["pool"], node_count=d["node_count"],
                    start=d["start"], end=d["end"], name=d["name"], orchestrator=d["orchestrator"],
                    cuda_version=d["cuda_version"],
                )
            except CapacityUnavailable as exc:
                form.add_error(None, _refusal(exc))
                suggestions = _suggestions(exc.extra.get("suggestions") or [])
                status = 409
            except InvalidInput as exc:
                form.apply_service_errors(exc.fields, exc.detail)
                status = 400
            except DomainError as exc:
                form.add_error(None, exc.detail)
                status = exc.status
                refusal = exc
            else:
                if _is_partial(request):
                    response = render_page(request, "reservations/_booking_done.html",
                                           {"reservation": reservation, "standalone": _on_booking_page(request)})
                    return trigger_client_event(response, "reservation-changed", {"id": reservation.pk})
                messages.success(request, f"Booked reservation #{reservation.pk}.")
                return HttpResponseRedirect(reverse("reservation-page", args=[reservation.pk]))
        else:
            status = 400
    else:
        pool_name = request.GET.get("pool")
        pool = Pool.objects.filter(name=pool_name).first() if pool_name else None
        start, end = _default_window(pool)
        form = BookingForm(
            initial={
                "tenant": portal.tenant.slug,
                "pool": pool_name,
                "node_count": 1,
                "start": request.GET.get("start") or start,
                "end": request.GET.get("end") or end,
            },
            user=request.user, tenant=portal.tenant,
        )
        if pool_name and not form.fields["pool"].queryset.filter(name=pool_name).exists():
            # The calendar shows every pool; booking is only in the tenant's quota pools. Never let the
            # select quietly show another pool (its first option) for a window picked on this one.
            form.fields["pool"].empty_label = "— choose a pool —"
            notice = f"{portal.tenant.name} has no quota in {pool_name}; choose one of its pools."
    context = {"form": form, "suggestions": suggestions, "notice": notice, "standalone": _on_booking_page(request)}
    if _is_partial(request):
        # htmx swaps only 2xx answers; the refusal is in the body.
        return render_page(request, "reservations/_booking_form.html", context)
    return _busy_answer(render_page(request, "reservations/booking_page.html", context, status=status), refusal)


@require_POST
@portal_view
def booking_preview(request):
    """The live preview beside the form: free nodes, quota after booking, committed vs burst, burst cost."""
    _require_booking(request)
    form = BookingForm(request.POST, user=request.user, tenant=request.portal.tenant)
    preview = None
    misaligned = False
    window_problems: list[str] = []
    if form.is_valid():
        d = form.cleaned_data
        preview = selectors.booking_preview(tenant=d["tenant"], pool=d["pool"], node_count=d["node_count"],
                                            start=d["start"], end=d["end"])
        minutes = d["pool"].slot_minutes
        misaligned = not (is_aligned(d["start"], minutes) and is_aligned(d["end"], minutes))
        if not misaligned:  # (the grid has its own line below)
            window_problems = services.booking_window_problems(pool=d["pool"], start=d["start"], end=d["end"])
    return render_page(request, "reservations/_preview.html", {"form": form, "preview": preview,
                                                               "misaligned": misaligned,
                                                               "window_problems": window_problems})


# --- one reservation --------------------------------------------------------------------------


def _instant(value) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _history(reservation) -> list:
    """The status timeline; a changed start or end as instants (the audit keeps UTC text), so the page
    shows them in the user's zone like every other time on it, and a node swap's two nodes."""
    entries = list(selectors.reservation_history(reservation=reservation))
    for h in entries:
        before, after = h.before or {}, h.after or {}
        h.changes = [
            (label, _instant(before.get(key)), _instant(after.get(key)))
            for key, label in (("start", "start"), ("end", "end"))
            if before.get(key) and after.get(key) and before[key] != after[key]
        ]
        # A node swap names the node that left and the one that took over ("" when no spare was free); not the
        # audit's reason (a health failure's words), which staff read on the node's page.
        h.swap = (after["failed"], after.get("spare") or "") \
            if h.action == "reservation.replace_node" and after.get("failed") else None
    return entries


def _fingerprint(*parts) -> str:
    """A short digest of what a polled part of the page shows: the poll sends it back, and the part comes again
    only when it differs."""
    return f"{zlib.crc32(repr(parts).encode()):08x}"


def _held_nodes(reservation) -> list[tuple[str, str, str]]:
    """The nodes the booking holds now, as the Nodes card shows them: (hostname, state, state in words)."""
    return sorted((a.node.hostname, a.node.state, a.node.get_state_display())
                  for a in reservation.active_allocations)


def _changeable(request, reservation, now: datetime) -> tuple[bool, bool]:
    """Whether the viewer may still change the booking (rename, cancel), and give it a new end: its cluster torn down
    early, an ending booking can still be cancelled but never given a new end."""
    changeable = request.portal.can_change(reservation) and not reservation.is_over and reservation.end > now
    return changeable, changeable and reservation.status != ReservationStatus.ENDING


def _polls_page(request) -> bool:
    """The reservation page's own poll (its cluster card's, or the placeholder's): see reservation_detail."""
    return bool(request.headers.get("HX-Request")) and "shown" in request.GET


def _polls_panel(request) -> bool:
    """The calendar's side panel's poll of its live part: see reservation_panel."""
    return bool(request.headers.get("HX-Request")) and "live" in request.GET


def _booking_context(request, reservation) -> dict:
    """What the reservation page and the calendar's side panel both show: the booking, its nodes and its actions
    (not its timeline, which the page alone shows: see _detail_context)."""
    pool = reservation.pool
    now = timezone.now()
    changeable, extendable = _changeable(request, reservation, now)
    slot = timedelta(minutes=pool.slot_minutes)
    # (label, the new end as the form posts it, the new end to show beside the label in the reader's zone)
    extend_options = [
        (label, format_utc(reservation.end + delta), reservation.end + delta)
        for label, delta in (("+1 slot", slot), ("+4 hours", timedelta(hours=4)), ("+1 day", timedelta(days=1)))
        if delta >= slot and delta % slot == timedelta(0)
    ]
    held = _held_nodes(reservation)
    return {
        "reservation": reservation,
        "nodes": [hostname for hostname, _, _ in held],
        "held_nodes": held,
        "changeable": changeable,
        "extendable": extendable,
        "extend_form": _extend_form(reservation),
        "extend_options": extend_options,
        "shown_end": format_utc(reservation.end),  # the extend forms send it back: a stale page is refused
        "rename_form": _rename_form(reservation),
        "shown_name": reservation.name,  # the rename form sends it back: a stale page is refused
        "gpus": reservation.node_count * pool.gpus_per_node,
        "hours": (reservation.end - reservation.start).total_seconds() / 3600,
        "now": now,
    }


def _detail_context(request, reservation) -> dict:
    context = _booking_context(request, reservation)
    now = context["now"]
    history = _history(reservation)
    # What the Nodes card and the timeline show, in a few characters: the poll says them back (see
    # reservation_detail). The timeline is the booking's audit trail, which only grows: its length and last entry
    # say whether it did, keyed with the site's secret, as the audit's ids are one sequence for the whole portal
    # (the page must not let a tenant count what everyone else did between two of its own changes).
    nodes_shown = _fingerprint(context["held_nodes"], reservation.missing_nodes)
    timeline_shown = salted_hmac("reservation-timeline", f"{len(history)}-{history[-1].pk if history else 0}",
                                 algorithm="sha256").hexdigest()[:16]
    page_url = reverse("reservation-page", args=[reservation.pk])
    return {
        **context,
        "history": history,
        "nodes_shown": nodes_shown,
        "timeline_shown": timeline_shown,
        "cluster_template": select_template(CLUSTER_TEMPLATES).template.name,
        # The cluster card polls the page itself, saying which status, nodes and timeline the page shows (see
        # reservation_detail); an active booking's page goes on polling, slowly, while its nodes can change.
        "cluster_poll_url": f"{page_url}?shown={reservation.status}&nodes={nodes_shown}&timeline={timeline_shown}",
        "cluster_watch_every": (f"{ACTIVE_POLL_SECONDS}s" if reservation.status == ReservationStatus.ACTIVE
                                and reservation.end > now else None),
    }


RESERVATION_PAGE_SIZE = 50


@require_safe
@portal_view
def reservation_list(request):
    """The current tenant's reservations, newest start first, filtered and a page at a time."""
    portal = request.portal
    form = ReservationListForm(request.GET or None)
    context: dict = {"form": form, "cluster_badge_template": select_template(CLUSTER_BADGE_TEMPLATES).template.name}
    if portal.tenant is not None:
        qs = selectors.reservations_for_user(user=request.user).for_tenant(portal.tenant)
        qs = form.filter(qs, user=request.user, now=timezone.now()) if form.is_bound else qs
        page = Paginator(_with_cluster(qs.order_by("-period", "-id")), RESERVATION_PAGE_SIZE).get_page(
            request.GET.get("page"))
        context.update(page=page, page_query=page_query(request))
    return render_page(request, "reservations/list.html", context, status=400 if form.is_bound and form.errors else 200)


@require_safe
@vary_on_headers("HX-Request")  # one URL, two answers: a browser must not cache the polled fragment as the page
@portal_view
@stops_polling_when_gone("booking", poll=_polls_page)
def reservation_detail(request, pk: int):
    reservation = get_object_or_404(_own_reservations(request), pk=pk)
    context = _detail_context(request, reservation)
    if _polls_page(request):
        # The cluster card's poll: the card, and the parts that follow the booking's status when it moved on
        # from the one the page shows (not every time: a form being filled in beside them is left alone).
        # The Nodes card and the timeline likewise, when they no longer show what the page has (a node swapped).
        # The cluster's placeholder polls likewise until the cluster's row exists (cluster=none): it gets the
        # whole cluster block, the card once there is one.
        context.update(cluster_poll_template=select_template(CLUSTER_POLL_TEMPLATES).template.name,
                       cluster_shown=request.GET.get("cluster") != "none",
                       status_moved=request.GET["shown"] != reservation.status,
                       nodes_moved=request.GET.get("nodes") != context["nodes_shown"],
                       timeline_moved=request.GET.get("timeline") != context["timeline_shown"])
        return render_page(request, "reservations/_detail_poll.html", context)
    return render_page(request, "reservations/detail.html", context)


def _cluster_status(reservation) -> str | None:
    """The status of the booking's cluster, when an app adds one and the booking has it (by the relation's name
    only, as _with_cluster: this app does not import the one that provides it)."""
    return getattr(getattr(reservation, "cluster", None), "status", None)  # no row (yet): Django's AttributeError


def _panel_marks(request, reservation) -> dict[str, str]:
    """What the calendar's panel shows, as the markers its poll sends back (see reservation_panel): its live part
    (status, window, nodes, cluster), its actions and the calendar's event. Read off the booking, its held nodes and
    its cluster alone: a poll that finds nothing changed answers from these, and an open panel polls every few
    seconds."""
    status = reservation.status
    changeable, extendable = _changeable(request, reservation, timezone.now())
    return {
        "live": _fingerprint(status, reservation.status_reason, reservation.start, reservation.end,
                             reservation.node_count, reservation.billing, _held_nodes(reservation),
                             reservation.missing_nodes, _cluster_status(reservation)),
        "actions": _fingerprint(changeable, extendable, format_utc(reservation.end), reservation.name),
        "event": _fingerprint(status, reservation.start, reservation.end, reservation.name),
    }


def _panel_context(request, reservation, marks: dict[str, str] | None = None) -> dict:
    """The panel's context (not the page's: no timeline, so no audit read), and the URL its live part polls with
    the markers of what it shows."""
    marks = marks or _panel_marks(request, reservation)
    status = reservation.status
    every = None
    if not reservation.is_over:
        every = ACTIVE_POLL_SECONDS if status == ReservationStatus.ACTIVE else PANEL_POLL_SECONDS
    return {
        **_booking_context(request, reservation),
        "cluster_badge_template": select_template(CLUSTER_BADGE_TEMPLATES).template.name,
        "panel_live_shown": marks["live"],
        "panel_actions_shown": marks["actions"],
        "panel_event_shown": marks["event"],
        "panel_poll_url": f"{reverse('reservation-panel', args=[reservation.pk])}?{urlencode(marks)}",
        "panel_poll_every": f"{every}s" if every else None,
    }


@require_safe
@vary_on_headers("HX-Request")  # one URL, two answers: the poll's fragment is not the panel
@portal_view
@stops_polling_when_gone("booking", poll=_polls_panel)
def reservation_panel(request, pk: int):
    """The calendar's side panel for one event.

    Its live part polls this URL, saying what it shows (?live=&actions=&event=): nothing changed is a 204 (htmx swaps
    nothing, and the part goes on polling); else the part again, with the booking's actions out-of-band only when
    they changed (a name or an end being typed there is not wiped by a node or a status moving on), and the calendar
    told to fetch its events again when the booking's event no longer looks as it did."""
    reservation = get_object_or_404(_with_cluster(_own_reservations(request)), pk=pk)
    marks = _panel_marks(request, reservation)
    if _polls_panel(request):
        live_moved = request.GET["live"] != marks["live"]
        actions_moved = request.GET.get("actions") != marks["actions"]
        if not live_moved and not actions_moved:
            return HttpResponse(status=204)
        context = _panel_context(request, reservation, marks)
        # The actions it sends replace those this poll's panel shows, named by what they show: an answer that
        # comes after the panel was loaded again (its booking cancelled there, or picked again) leaves the new
        # panel's alone. A marker that is no digest names no actions on any panel.
        actions_was = request.GET.get("actions", "")
        response = render_page(request, "reservations/_panel_poll.html", {
            **context, "actions_moved": actions_moved,
            "actions_was": actions_was if PANEL_MARK.fullmatch(actions_was) else None})
        if request.GET.get("event") != context["panel_event_shown"]:
            response = trigger_client_event(response, "reservation-changed", {"id": reservation.pk})
        return response
    return render_page(request, "reservations/_panel.html", _panel_context(request, reservation, marks))


def _extend_form(reservation, data=None) -> ExtendForm:
    slot = timedelta(minutes=reservation.pool.slot_minutes)
    return ExtendForm(data, initial={"end": reservation.end + slot}, auto_id=f"extend-%s-{reservation.pk}")


def _change_from_page(request, pk: int, *, form_for, field: str, refused: str, done, form_key: str, shown_key: str,
                      shown_field: str | None = None):
    """Change one field of a booking from its page (extend, rename); a refusal comes back as the page with the
    value given and the reason beside the field, or above the page when the field is not shown (shown_key: the
    context flag of the role or the booking's state). shown_field: the form's hidden field with the value the
    page showed, which the service checks is still so."""
    reservation = get_object_or_404(_own_reservations(request), pk=pk)
    form = form_for(reservation, request.POST)
    status = 400
    refusal: DomainError | None = None
    if form.is_valid():
        shown = form.cleaned_data.get(shown_field) if shown_field else None
        try:
            reservation = services.reservation_update(actor=request.user, reservation=reservation,
                                                      **{field: form.cleaned_data[field]},
                                                      expected={field: shown} if shown is not None else None)
        except DomainError as exc:
            # The service names the API's field ("end: Must be after start."); beside the field, its reason.
            reason = exc.fields.get(field) if isinstance(exc, InvalidInput) else None
            form.add_error(field, f"{refused}: {reason or _refusal(exc)}")
            status = exc.status
            refusal = exc
        else:
            messages.success(request, done(reservation))
            return HttpResponseRedirect(reverse("reservation-page", args=[reservation.pk]))
    reservation = get_object_or_404(_own_reservations(request), pk=pk)  # as stored: nothing changed
    context = {**_detail_context(request, reservation), form_key: form}
    if not context[shown_key]:  # no field to show the reason beside
        text = " ".join(form.errors.get(field, []))
        messages.error(request, text if text.startswith(refused) else f"{refused}: {text}")
    return _busy_answer(render_page(request, "reservations/detail.html", context, status=status), refusal)


def _extended(reservation) -> str:
    end = date_format(timezone.localtime(reservation.end), services.PAGE_TIME_FORMAT)  # as the pages write it
    return f"Reservation #{reservation.pk} now ends {end}."


def _renamed(reservation) -> str:
    if reservation.name:
        return f"Reservation #{reservation.pk} renamed to “{reservation.name}”."
    return f"Reservation #{reservation.pk} no longer has a name."


@require_POST
@portal_view
def reservation_extend(request, pk: int):
    """Change the end."""
    return _change_from_page(request, pk, form_for=_extend_form, field="end", refused="Not changed", done=_extended,
                             form_key="extend_form", shown_key="extendable", shown_field="shown_end")


def _rename_form(reservation, data=None) -> RenameForm:
    return RenameForm(data, initial={"name": reservation.name}, auto_id=f"rename-%s-{reservation.pk}")


@require_POST
@portal_view
def reservation_rename(request, pk: int):
    """Rename."""
    return _change_from_page(request, pk, form_for=_rename_form, field="name", refused="Not renamed", done=_renamed,
                             form_key="rename_form", shown_key="changeable", shown_field="shown_name")


@require_http_methods(["GET", "POST"])
@portal_view
def reservation_cancel(request, pk: int):
    """GET asks for confirmation (a page that works without JavaScript); POST cancels."""
    reservation = get_object_or_404(_own_reservations(request), pk=pk)
    if request.method == "GET":
        return render_page(request, "reservations/cancel_confirm.html", _detail_context(request, reservation))
    try:
        reservation = services.reservation_cancel(actor=request.user, reservation=reservation)
    except Busy:
        raise  # BusyPageMiddleware: 503 with Retry-After, "nothing was changed, try again"
    except DomainError as exc:
        ok, text = False, f"Not cancelled: {exc.detail}"
    else:
        ok, text = True, f"Reservation #{reservation.pk} cancelled; its nodes are free again."
    if _is_partial(request):
        # The panel says it itself: a queued message would surface on whatever page loads next.
        reservation = get_object_or_404(_with_cluster(_own_reservations(request)), pk=pk)
        context = {**_panel_context(request, reservation), "panel_message": text, "panel_ok": ok}
        response = render_page(request, "reservations/_panel.html", context)
        # Said after the swap: htmx dispatches HX-Trigger's events on the Cancel link that sent this, which a poll
        # answered meanwhile may have replaced (new actions), and an event on a detached element reaches no
        # listener; after the swap, htmx dispatches it on the page's body then (the calendar listens there).
        if ok:
            response = trigger_client_event(response, "reservation-changed", {"id": reservation.pk}, after="swap")
        return response
    (messages.success if ok else messages.error)(request, text)
    return HttpResponseRedirect(reverse("reservation-page", args=[pk]))


# --- availability heatmap ---------------------------------------------------------------------


def heatmap_rows(*, slots, tz, first_day: date, days: int, now: datetime, total: int,
                 bookable: tuple[datetime, datetime] | None = None) -> list[dict]:
    """Lay slots out as one row per local day and one cell per local hour.

    A cell is the local hour's own span of time (60 minutes, or 30/90 around a half-hour DST
    shift) and shows the least free count of the slots it overlaps — slots of any length (15, 90,
    1440 minutes), on a grid that local hours need not share (+05:30, +05:45). A day on which the
    clocks change repeats an hour (both spans fold into one cell showing the lower count, flagged
    `twice`) or skips one (that cell is None): nothing is ever misplaced.

    bookable is the span a new booking may take now (services.bookable_span): the slots are cut at its
    bounds, as on the calendar, and a cell none of whose time is bookable shows no free count but why
    (`not_bookable`: "past" or "horizon", and its `hint`).
    """
    slots = sorted(slots, key=lambda s: s.start)
    if bookable is None:
        parts = [(s.start, s.end, s.free_nodes, None) for s in slots]
    else:
        parts = list(_bookable_parts(slots, *bookable))
    starts = [part[0] for part in parts]
    first = datetime.combine(first_day, datetime.min.time(), tzinfo=tz).astimezone(UTC) - timedelta(hours=3)
    last = datetime.combine(first_day + timedelta(days=days), datetime.min.time(), tzinfo=tz).astimezone(UTC) \
        + timedelta(hours=3)
    # Where each local hour begins: every quarter hour of UTC time is a candidate (zone offsets and
    # their shifts are multiples of 15 minutes); a local minute of 0 starts an hour cell.
    quarter = timedelta(minutes=15)
    bounds: list[tuple[datetime, tuple[date, int]]] = []
    t = first
    while t <= last:
        local = t.astimezone(tz)
        if local.minute == 0:
            bounds.append((t, (local.date(), local.hour)))
        t += quarter
    cells: dict[tuple[date, int], dict] = {}
    for (a, key), (b, _) in zip(bounds, bounds[1:], strict=False):
        if not first_day <= key[0] < first_day + timedelta(days=days):
            continue
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        free = reason = None
        while i < len(parts) and parts[i][0] < b:
            lo, hi, part_free, part_reason = parts[i]
            if hi > a:
                if part_free is not None:
                    free = part_free if free is None else min(free, part_free)
                elif reason is None:
                    reason = part_reason
            i += 1
        if free is None and reason is None:
            continue
        cell = cells.get(key)
        if cell is not None:  # the same wall-clock hour again: the clocks went back
            cell["twice"] = True
            if free is None:
                continue
            if cell["free"] is not None:
                free = min(cell["free"], free)
        elif free is None:  # nothing in this hour can be booked now
            cells[key] = {"free": None, "start": a, "past": reason == "past", "twice": False, "level": None,
                          "not_bookable": reason, "hint": not_bookable_hint(reason)}
            continue
        else:
            cell = cells[key] = {"start": a, "twice": False}
        cell.update(free=free, past=b <= now and cell.get("past", True), level=_level(free, total),
                    not_bookable=None, hint="")
    rows = []
    for i in range(days):
        day = first_day + timedelta(days=i)
        rows.append({"day": day, "cells": [cells.get((day, h)) for h in range(24)]})
    return rows


def _refresh_seconds(request) -> int:
    try:
        return min(300, max(2, int(request.GET.get("refresh", HEATMAP_REFRESH_SECONDS))))
    except ValueError:
        return HEATMAP_REFRESH_SECONDS


def _heatmap_context(*, refresh: int = HEATMAP_REFRESH_SECONDS) -> dict:
    tz = timezone.get_current_timezone()
    now = timezone.now()
    today = timezone.localdate(now)
    start = datetime.combine(today, datetime.min.time(), tzinfo=tz)
    end = datetime.combine(today + timedelta(days=HEATMAP_DAYS), datetime.min.time(), tzinfo=tz)
    pools = [
        {"pool": pool, "total": total,
         "rows": heatmap_rows(slots=slots, tz=tz, first_day=today, days=HEATMAP_DAYS, now=now, total=total,
                              bookable=services.bookable_span(pool=pool, now=now))}
        for pool, total, slots in selectors.pool_heatmap(start=start.astimezone(UTC), end=end.astimezone(UTC))
    ]
    return {"heatmap": pools, "hours": range(24), "updated": now, "refresh": refresh,
            "booking_horizon_days": settings.PORTAL_BOOKING_HORIZON_DAYS}


@require_safe
@portal_view
def heatmap(request):
    return render_page(request, "reservations/heatmap.html", _heatmap_context(refresh=_refresh_seconds(request)))


@require_safe
@portal_view
def heatmap_grid(request):
    """The part of the heatmap page that htmx polls."""
    return render_page(request, "reservations/_heatmap.html", _heatmap_context(refresh=_refresh_seconds(request)))


# --- staff fleet timeline ---------------------------------------------------------------------


def _hue(slug: str) -> int:
    return zlib.crc32(slug.encode()) % 360


@require_safe
@portal_view(staff_only=True)
def fleet(request):
    form = FleetWindowForm(request.GET or None)
    lo, hi = form.window()
    pool = getattr(form, "cleaned_data", {}).get("pool")  # window() validated; an unbound form has none
    # A page of nodes at a time: a fleet of thousands is megabytes of bars otherwise.
    page = Paginator(selectors.fleet_nodes(pool=pool), FLEET_PAGE_SIZE).get_page(request.GET.get("page"))
    nodes, by_node = selectors.fleet_timeline(user=request.user, start=lo, end=hi, nodes=page.object_list)
    span = (hi - lo).total_seconds()
    now = timezone.now()

    def pct(t: datetime) -> float:
        return round(100 * (min(max(t, lo), hi) - lo).total_seconds() / span, 3)

    rows = []
    for node in nodes:
        bars = []
        for a in by_node.get(node.pk, []):
            left, right = pct(a.period.lower), pct(a.period.upper)
            r = a.reservation
            bar = {"left": left, "width": max(right - left, 0.2), "start": a.period.lower, "end": a.period.upper,
                   "kind": a.kind}
            if r is not None:
                bar.update(label=f"{r.tenant.slug} · {r.name or f'#{r.pk}'}", tenant=r.tenant, reservation=r,
                           hue=_hue(r.tenant.slug), url=reverse("reservation-page", args=[r.pk]))
            else:
                bar.update(label=f"maintenance{': ' + a.note if a.note else ''}")
            bars.append(bar)
        rows.append({"node": node, "bars": bars})
    tz = timezone.get_current_timezone()
    ticks = []
    day = timezone.localtime(lo).date()
    # Every 6 hours a line; a label only where it fits (at the timeline's 960 px minimum): over a week or two
    # the hours' labels ran into one another, so there only the days are named (shorter past a week).
    days_shown = span / 86400
    hour_labels, day_format = days_shown <= 3.1, "D j M" if days_shown <= 7.1 else "D j"
    while True:
        for hour in (0, 6, 12, 18):
            t = datetime.combine(day, datetime.min.time(), tzinfo=tz).replace(hour=hour)
            if lo <= t < hi:
                label = date_format(t, day_format) if hour == 0 else (date_format(t, "H:i") if hour_labels else "")
                ticks.append({"left": pct(t), "at": t, "day": hour == 0, "label": label})
        day += timedelta(days=1)
        if datetime.combine(day, datetime.min.time(), tzinfo=tz) >= hi:
            break
    context = {
        "form": form,
        "page": page,
        "page_query": page_query(request),
        "rows": rows,
        "ticks": ticks,
        "lo": lo,
        "hi": hi,
        "now_pct": pct(now) if lo <= now < hi else None,
        "tenants": sorted({b["tenant"] for row in rows for b in row["bars"] if "tenant" in b}, key=lambda t: t.slug),
    }
    for tenant in context["tenants"]:
        tenant.hue = _hue(tenant.slug)
    return render_page(request, "reservations/fleet.html", context)


# --- iCalendar feed ---------------------------------------------------------------------------


@require_safe
def ical_feed(request, slug: str, token: str):
    """The tenant's reservations as text/calendar. The member's secret token in the URL is the credential."""
    tenant = ical_feed_tenant(slug=slug, token=token)
    if tenant is None:
        raise Http404("No such feed.")
    now = timezone.now()
    body = build_feed(
        tenant=tenant,
        reservations=selectors.feed_reservations(tenant=tenant, since=now - FEED_HISTORY),
        base_url=request.build_absolute_uri("/"),
    )
    response = HttpResponse(body, content_type="text/calendar; charset=utf-8")
    response["Content-Disposition"] = f'inline; filename="{tenant.slug}-reservations.ics"'
    response["Cache-Control"] = "private, max-age=300"
    response["X-Robots-Tag"] = "noindex"
    response["Referrer-Policy"] = "no-referrer"
    return response
