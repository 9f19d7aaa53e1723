"""Usage statements: GPU-hours per tenant and pool for a calendar month (UTC), committed vs burst.

The page (leads: their current tenant; staff: every tenant), its CSV download and the REST
endpoint all read ``selectors.usage_for_period``; who may see which tenant is decided here once.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe

from portal.core.exceptions import InvalidInput
from tenants.choices import Role
from tenants.models import Membership, Tenant
from tenants.views import portal_view, render_page

from .selectors import UsageLine, usage_for_period

__all__ = ["Month", "parse_month", "usage_tenant_ids", "usage_page", "usage_csv"]

_MONTH = re.compile(r"^(\d{4})-(\d{2})$")


@dataclass(frozen=True)
class Month:
    year: int
    month: int

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return self.next.start

    @property
    def next(self) -> Month:
        return Month(self.year + self.month // 12, self.month % 12 + 1)

    @property
    def previous(self) -> Month:
        return Month(self.year - (self.month == 1), (self.month - 2) % 12 + 1)

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"


# What a bad ?month= is told: the page and the CSV show it as it is; the API's detail names the field first.
MONTH_REFUSED = "Give the month as YYYY-MM, from 2000-01 to 9998-12, e.g. 2026-11."


def parse_month(raw: str | None, *, now: datetime | None = None) -> Month:
    """'YYYY-MM' (a UTC calendar month); none given: the current one. Raises InvalidInput naming month."""
    if not raw:
        now = now or timezone.now()
        return Month(now.astimezone(UTC).year, now.astimezone(UTC).month)
    match = _MONTH.match(raw)
    if not match or not (1 <= int(match.group(2)) <= 12) or not (2000 <= int(match.group(1)) <= 9998):
        raise InvalidInput("month: a calendar month as YYYY-MM, e.g. 2026-11.", fields={"month": MONTH_REFUSED})
    return Month(int(match.group(1)), int(match.group(2)))


def usage_tenant_ids(user: Any) -> list[int] | None:
    """The tenants whose usage user may read: staff every one (None), a lead the tenants they lead."""
    if user.is_staff:
        return None
    return list(Membership.objects.filter(user=user, role=Role.LEAD).values_list("tenant_id", flat=True))


def _totals(lines: list[UsageLine]) -> dict[str, Decimal]:
    keys = ("committed_used", "burst_used", "burst_cost_used", "committed_ahead", "burst_ahead", "burst_cost_ahead")
    return {key: sum((getattr(line, key) for line in lines), Decimal("0.00")) for key in keys}


def _page_scope(request) -> tuple[list[int] | None, Tenant | None]:
    """Staff: every tenant, or the one named by ?tenant=; a lead: their current tenant; else refused."""
    portal = request.portal
    if portal.is_staff:
        slug = request.GET.get("tenant") or ""
        if not slug:
            return None, None
        tenant = Tenant.objects.filter(slug=slug).first()
        return ([tenant.pk] if tenant else []), tenant
    if portal.tenant is None or portal.role != Role.LEAD:
        raise PermissionDenied("Usage statements are for the tenant's leads and platform staff.")
    return [portal.tenant.pk], portal.tenant


def _lines_for(request) -> tuple[Month, list[UsageLine], Tenant | None]:
    tenant_ids, tenant = _page_scope(request)
    month = parse_month(request.GET.get("month"))
    if tenant_ids == []:
        return month, [], tenant
    return month, usage_for_period(start=month.start, end=month.end, tenant_ids=tenant_ids), tenant


def _plain(exc: InvalidInput) -> str:
    """A refusal as a reader reads it: the month's own sentence, not the API's "month: …" detail."""
    return exc.fields.get("month") or exc.detail


@require_safe
@portal_view
def usage_page(request):
    try:
        month, lines, tenant = _lines_for(request)
    except InvalidInput as exc:
        return render_page(request, "reservations/usage.html", {"error": _plain(exc), "month": parse_month(None)},
                           status=400)
    now = timezone.now()
    context = {
        "month": month,
        "lines": lines,
        "totals": _totals(lines),
        "tenant": tenant,
        "all_tenants": request.portal.is_staff and tenant is None,
        "tenants": Tenant.objects.order_by("slug") if request.portal.is_staff else [],
        "current": month.start <= now < month.end,
        "future": month.start > now,
    }
    return render_page(request, "reservations/usage.html", context)


@require_safe
@portal_view
def usage_csv(request):
    try:
        month, lines, _tenant = _lines_for(request)
    except InvalidInput as exc:
        return HttpResponse(_plain(exc) + "\n", status=400, content_type="text/plain; charset=utf-8")
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="gpu-usage-{month}.csv"'
    writer = csv.writer(response)
    writer.writerow(["month", "tenant", "pool", "gpus_per_node", "committed_gpu_hours", "burst_gpu_hours",
                     "on_demand_rate", "burst_cost", "committed_gpu_hours_ahead", "burst_gpu_hours_ahead",
                     "burst_cost_ahead"])
    for line in lines:
        writer.writerow([str(month), line.tenant.slug, line.pool.name, line.gpus_per_node, line.committed_used,
                         line.burst_used, line.rate, line.burst_cost_used, line.committed_ahead, line.burst_ahead,
                         line.burst_cost_ahead])
    return response
