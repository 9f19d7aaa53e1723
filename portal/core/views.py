"""The audit log as a page: a tenant's lead sees every change made to their tenant; staff see all.

The core app sits below tenants, so it does not import them: a user's lead roles come through
the ``memberships`` reverse relation, and staff's tenant names through the app registry. The
root URLconf wraps the view in ``tenants.views.portal_view`` (sign-in, the page header's portal
context, the user's time zone), as every portal page is.
"""

from __future__ import annotations

from django.apps import apps
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse
from django.utils.text import capfirst
from django.views.decorators.http import require_GET

from .admin import format_change
from .models import AuditLog
from .templatetags.audit import field_value_words, field_words

__all__ = ["audit_log", "page_query"]

PAGE_SIZE = 50
LEAD = "lead"


def _visible_tenants(user) -> dict[int, str]:
    """Return {tenant id: name} of the tenants whose audit the user may read."""
    if user.is_staff:
        Tenant = apps.get_model("tenants", "Tenant")
        return dict(Tenant.objects.values_list("pk", "name"))
    memberships = user.memberships.filter(role=LEAD).select_related("tenant")
    return {m.tenant_id: m.tenant.name for m in memberships}


@require_GET
def audit_log(request):
    tenants = _visible_tenants(request.user)
    if not tenants and not request.user.is_staff:
        raise PermissionDenied("Only a tenant's lead can read its audit log.")
    qs = AuditLog.objects.select_related("actor").filter(tenant_id__in=list(tenants))
    if request.user.is_staff and request.GET.get("all") == "1":
        qs = AuditLog.objects.select_related("actor")  # including fleet changes with no tenant
    selected = request.GET.get("tenant", "")
    # ASCII digits, and few of them: isdigit() also accepts "²" and 5000 digits, which int() refuses (a 500).
    if selected.isascii() and selected.isdigit() and len(selected) <= 18 and int(selected) in tenants:
        qs = qs.filter(tenant_id=int(selected))
    action = request.GET.get("action", "").strip()
    if action:
        qs = qs.filter(action__startswith=action)
    page = Paginator(qs, PAGE_SIZE).get_page(request.GET.get("page"))
    rows = [
        {"entry": e, "tenant": tenants.get(e.tenant_id, ""),
         # Field names and coded values in words (the admin shows them as stored).
         "change": format_change(e.before or {}, e.after or {}, label=field_words, value=field_value_words),
         "object": object_name(e.object_type), "url": object_url(e.object_type, e.object_id)}
        for e in page.object_list
    ]
    return render(request, "core/audit_list.html", {
        "portal": getattr(request, "portal", None), "page": page, "rows": rows,
        "tenants": sorted(tenants.items(), key=lambda t: t[1]), "selected": selected, "action": action,
        "page_query": page_query(request),
    })


# The pages an audited object has, by its model label: named by URL, as the core app imports no app above it.
_OBJECT_PAGES = {"reservations.reservation": "reservation-page", "provisioning.virtualcluster": "cluster-page"}


def object_name(label: str) -> str:
    """An audit row's object type in words: "reservations.reservation" -> "Reservation"."""
    try:
        return capfirst(apps.get_model(label)._meta.verbose_name)
    except (LookupError, ValueError):
        return label


def object_url(label: str, object_id: str) -> str:
    """The page of an audited object ("" where it has none): the audit page's and the dashboard's links."""
    name = _OBJECT_PAGES.get(label)
    if name is None or not (object_id.isascii() and object_id.isdigit()):
        return ""
    try:
        return reverse(name, args=[int(object_id)])
    except NoReverseMatch:
        return ""


def page_query(request) -> str:
    """A paged list's other query parameters (its filters) for its paging links: encoded, ending in "&"
    when there are any, so a link is "?{{ page_query }}page=N"."""
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode() + "&" if query else ""
