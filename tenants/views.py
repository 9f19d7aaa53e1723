"""Browser pages for signing in, the tenant switcher and the user's time zone.

`portal_view` is the one entry point every HTML page of the portal goes through: it requires
a signed-in user, resolves the current tenant and role (from the session, within
`Tenant.objects.for_user`) and renders in the user's time zone.
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import wraps
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, Subquery
from django.http import Http404, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST, require_safe
from django_htmx.http import HttpResponseClientRedirect, HttpResponseStopPolling

from portal.core.exceptions import DomainError

from . import selectors, services
from .choices import BOOKING_ROLES, Role
from .forms import (
    ApiTokenForm,
    LockoutAuthenticationForm,
    TeamAddForm,
    TeamRoleForm,
    TenantSwitchForm,
    TimeZoneForm,
    valid_time_zone,
)
from .models import Membership, Tenant

__all__ = [
    "Portal",
    "resolve_portal",
    "portal_view",
    "portal_json",
    "render_page",
    "stops_polling_when_gone",
    "LoginView",
    "tenant_switch",
    "account",
    "api_token_create",
    "api_token_revoke",
    "team",
    "team_add",
    "team_set_role",
    "team_remove",
]

SESSION_TENANT = "portal_tenant"
SESSION_TZ = "portal_tz"


@dataclass
class Portal:
    """Who is looking, for which tenant, in which role and time zone."""

    user: Any
    tenants: list[Tenant] = field(default_factory=list)
    tenant: Tenant | None = None
    role: str | None = None
    tz_name: str = "UTC"

    @property
    def tz(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.tz_name)

    @property
    def is_staff(self) -> bool:
        return bool(self.user.is_staff)

    @property
    def can_book(self) -> bool:
        """Show booking controls: staff, leads and members (viewers read only). Services still decide."""
        return self.tenant is not None and (self.is_staff or self.role in BOOKING_ROLES)

    @property
    def is_lead(self) -> bool:
        return self.is_staff or self.role == Role.LEAD

    def role_in(self, tenant_id: int | None) -> str | None:
        """The user's role in one of their tenants (not only the current one); "staff" for staff."""
        if self.is_staff:
            return "staff"
        return next((t.my_role for t in self.tenants if t.pk == tenant_id), None)

    def can_change(self, reservation) -> bool:
        """Show change/cancel controls on any of the user's reservations: by their role in the
        reservation's tenant (a lead of one tenant may be a viewer of another), leads and staff any
        booking, members their own."""
        role = self.role_in(reservation.tenant_id)
        if role in ("staff", Role.LEAD):
            return True
        return role == Role.MEMBER and reservation.created_by_id == self.user.pk

    def may_change(self, *, created_by_id: int | None) -> bool:
        if self.is_lead:
            return True
        return self.role == Role.MEMBER and created_by_id == self.user.pk


def resolve_portal(request) -> Portal:
    """Return the user's tenants (one query, with their role in each) and the current one."""
    user = request.user
    my_role = Membership.objects.filter(tenant=OuterRef("pk"), user=user).values("role")[:1]
    tenants = list(Tenant.objects.for_user(user).annotate(my_role=Subquery(my_role)).order_by("slug"))
    wanted = request.session.get(SESSION_TENANT)
    tenant = next((t for t in tenants if t.slug == wanted), tenants[0] if tenants else None)
    role = None
    if tenant is not None:
        role = tenant.my_role or ("staff" if user.is_staff else None)
    tz_name = valid_time_zone(request.session.get(SESSION_TZ)) or "UTC"
    return Portal(user=user, tenants=tenants, tenant=tenant, role=role, tz_name=tz_name)


def portal_view(view=None, *, staff_only: bool = False):
    """Decorate an HTML view: sign-in required, request.portal set, rendered in the user's zone."""

    def decorate(fn):
        @wraps(fn)
        def wrapper(request, *args, **kwargs):
            if not request.user.is_authenticated:
                return _to_sign_in(request)
            request.portal = resolve_portal(request)
            if staff_only and not request.user.is_staff:
                raise PermissionDenied("Platform staff only.")
            with timezone.override(request.portal.tz):
                return fn(request, *args, **kwargs)

        return wrapper

    return decorate(view) if view is not None else decorate


def _to_sign_in(request):
    """Send a signed-out user to the sign-in page. An htmx request (a panel, a poll) gets the whole
    window sent there, back to the page it came from: following the redirect itself would paste the
    sign-in page into the fragment's target."""
    htmx = getattr(request, "htmx", False)
    if htmx:
        back = htmx.current_url_abs_path or settings.LOGIN_REDIRECT_URL
        return HttpResponseClientRedirect(redirect_to_login(back)["Location"])
    if request.method not in ("GET", "HEAD"):
        # A form sent after the session ended (“+1 day”, “Add to team”): after signing in the browser
        # GETs `next`, and a POST-only address would answer 405. Back to the page the form was on instead;
        # what it asked for is not done behind the user's back, so say so.
        messages.info(request, "You were signed out, so that was not done: sign in and try again.")
        back = _same_site_path(request, request.headers.get("referer"))
        return redirect_to_login(back or settings.LOGIN_REDIRECT_URL)
    return redirect_to_login(request.get_full_path())


def _same_site_path(request, url: str | None) -> str | None:
    """The path (and query) of url when it is this site's own address, else None."""
    if not url or not url_has_allowed_host_and_scheme(url, allowed_hosts={request.get_host()},
                                                      require_https=request.is_secure()):
        return None
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "") or None


def portal_json(fn):
    """Decorate a JSON view: 401 envelope without a session (no redirect), else like portal_view."""

    @wraps(fn)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return JsonResponse({"code": "not_authenticated", "detail": "Sign in first.", "fields": {}}, status=401)
        request.portal = resolve_portal(request)
        with timezone.override(request.portal.tz):
            return fn(request, *args, **kwargs)

    return wrapper


def render_page(request, template: str, context: dict[str, Any] | None = None, *, status: int = 200):
    ctx = {"portal": getattr(request, "portal", None)}
    ctx.update(context or {})
    return render(request, template, ctx, status=status)


_ELEMENT_ID = re.compile(r"[A-Za-z][\w-]{0,99}")


def stops_polling_when_gone(what: str, *, poll: Callable[[Any], bool] = lambda request: True):
    """Decorate a view that a part of a page polls (an htmx request that poll(request) recognises): when its object
    is out of the user's sight (Http404: their place in its team ended, someone else signed in in this browser), the
    poll is answered 286, which stops htmx polling, with the polled part (HX-Target) replaced by a notice. A 404 was
    said once and asked for again every few seconds for as long as the page stayed open. The answer names no object:
    the same for one that never existed. Any other request gets the 404 as before."""

    def decorate(fn):
        @wraps(fn)
        def wrapper(request, *args, **kwargs):
            try:
                return fn(request, *args, **kwargs)
            except Http404:
                target = request.headers.get("HX-Target", "")
                if not (request.headers.get("HX-Request") and poll(request) and _ELEMENT_ID.fullmatch(target)):
                    raise
                return render_page(request, "_poll_gone.html", {"target": target, "what": what},
                                   status=HttpResponseStopPolling.status_code)

        return wrapper

    return decorate


class LoginView(auth_views.LoginView):
    form_class = LockoutAuthenticationForm
    template_name = "registration/login.html"
    redirect_authenticated_user = True

    def get_redirect_url(self):
        """next, unless it is this sign-in page itself: for a signed-in user Django's LoginView raises
        ValueError ("Redirection loop") on that (a 500), and after signing in it is a pointless hop."""
        url = super().get_redirect_url()
        if url and urlsplit(url).path == self.request.path:
            return ""
        return url

    def form_valid(self, form):
        response = super().form_valid(form)
        # The browser's zone (sent by the sign-in page's script) until the user picks another.
        tz = valid_time_zone(form.cleaned_data.get("tz"))
        if tz:
            self.request.session[SESSION_TZ] = tz
        return response

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.is_locked:
            response.status_code = 429
        return response


def _safe_next(request, fallback: str) -> str:
    target = request.POST.get("next") or request.META.get("HTTP_REFERER") or ""
    if url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                       require_https=request.is_secure()):
        return target
    return fallback


@require_POST
@portal_view
def tenant_switch(request):
    form = TenantSwitchForm(request.POST, user=request.user)
    if form.is_valid():
        tenant = form.cleaned_data["tenant"]
        request.session[SESSION_TENANT] = tenant.slug
        messages.info(request, f"Now working as {tenant.name}.")
    else:
        messages.error(request, "You are not a member of that tenant.")
    return HttpResponseRedirect(_safe_next(request, settings.LOGIN_REDIRECT_URL))


@require_http_methods(["GET", "POST"])
@portal_view
def account(request):
    if request.method == "POST":
        form = TimeZoneForm(request.POST)
        if form.is_valid():
            request.session[SESSION_TZ] = form.cleaned_data["tz"]
            messages.success(request, f"Times are now shown in {form.cleaned_data['tz']}.")
            return HttpResponseRedirect(request.path)
    else:
        form = TimeZoneForm(initial={"tz": request.portal.tz_name})
    return _account_page(request, form=form)


def _account_page(request, *, form=None, token_form=None, new_token=None, status: int = 200):
    context = {
        "form": form or TimeZoneForm(initial={"tz": request.portal.tz_name}),
        "now": timezone.now(),
        "token_form": token_form or ApiTokenForm(),
        "tokens": list(selectors.api_tokens_of(user=request.user)),
        "max_live_tokens": services.MAX_LIVE_TOKENS,
        "new_token": new_token,
    }
    response = render_page(request, "tenants/account.html", context, status=status)
    if new_token is not None:
        add_never_cache_headers(response)  # the plaintext is in this page, and only in this page
    return response


@require_POST
@portal_view
def api_token_create(request):
    """Issue the signed-in user a personal API token; its plaintext is in this response only."""
    form = ApiTokenForm(request.POST)
    if not form.is_valid():
        return _account_page(request, token_form=form, status=400)
    try:
        token, key = services.token_issue_own(user=request.user, name=form.cleaned_data["name"],
                                              expires_in_days=form.expires_in_days)
    except DomainError as exc:
        form.add_error(None, exc.detail)
        return _account_page(request, token_form=form, status=exc.status)
    return _account_page(request, new_token={"token": token, "key": key})


@require_POST
@portal_view
def api_token_revoke(request, pk: int):
    try:
        token = services.token_revoke_own(user=request.user, token_id=pk)
    except DomainError as exc:
        messages.error(request, exc.detail)
        return HttpResponseRedirect(reverse("account"))
    messages.success(request, f"Token {token.prefix}… revoked: requests presenting it are refused from now on.")
    return HttpResponseRedirect(reverse("account") + "#api-tokens")


@require_POST
@portal_view
def ical_token_rotate(request):
    """Give the current tenant a new calendar-feed address (leads and staff)."""
    portal = request.portal
    if portal.tenant is None or not portal.is_lead:
        raise PermissionDenied("Only the tenant's lead can change the calendar feed address.")
    try:  # the service decides again, under the team lock (a lead demoted meanwhile is refused)
        services.tenant_rotate_ical_token(actor=request.user, tenant=portal.tenant)
    except DomainError as exc:
        raise PermissionDenied(exc.detail) if exc.status == 403 else exc
    messages.success(request, "New calendar feed address issued; the old one no longer works.")
    return HttpResponseRedirect(_safe_next(request, settings.LOGIN_REDIRECT_URL))


# --- the team page ----------------------------------------------------------------------------


def _team_tenant(request) -> Tenant:
    tenant = request.portal.tenant
    if tenant is None:
        raise PermissionDenied("You are not a member of any tenant yet.")
    return tenant


def _team_page(request, *, add_form=None, status: int = 200):
    portal = request.portal
    tenant = _team_tenant(request)
    members = list(selectors.team_of(tenant=tenant))
    context = {
        "tenant": tenant,
        "members": members,
        "can_manage": portal.is_lead,
        "add_form": add_form or TeamAddForm(),
        "roles": Role.choices,
        "lead_count": sum(1 for m in members if m.role == Role.LEAD),
    }
    return render_page(request, "tenants/team.html", context, status=status)


@require_safe
@portal_view
def team(request):
    """The current tenant's members and roles; its leads (and staff) add, change and remove them."""
    return _team_page(request)


@require_POST
@portal_view
def team_add(request):
    tenant = _team_tenant(request)
    form = TeamAddForm(request.POST)
    if not form.is_valid():
        return _team_page(request, add_form=form, status=400)
    try:
        membership = services.team_member_add(actor=request.user, tenant=tenant,
                                              username=form.cleaned_data["username"], role=form.cleaned_data["role"])
    except DomainError as exc:
        for name, text in (getattr(exc, "fields", None) or {}).items():
            form.add_error(name if name in form.fields else None, text)
        if not form.errors:
            form.add_error(None, exc.detail)
        return _team_page(request, add_form=form, status=exc.status)
    messages.success(request, f"{membership.user.username} joined {tenant.name} as {membership.role}.")
    return HttpResponseRedirect(reverse("team"))


@require_POST
@portal_view
def team_set_role(request, pk: int):
    tenant = _team_tenant(request)
    form = TeamRoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose lead, member or viewer.")
        return HttpResponseRedirect(reverse("team"))
    try:
        membership = services.team_member_set_role(actor=request.user, tenant=tenant, membership_id=pk,
                                                   role=form.cleaned_data["role"])
    except DomainError as exc:
        messages.error(request, exc.detail)
        return HttpResponseRedirect(reverse("team"))
    messages.success(request, f"{membership.user.username} is now {membership.role} of {tenant.name}.")
    return HttpResponseRedirect(reverse("team"))


@require_POST
@portal_view
def team_remove(request, pk: int):
    tenant = _team_tenant(request)
    try:
        membership = services.team_member_remove(actor=request.user, tenant=tenant, membership_id=pk)
    except DomainError as exc:
        messages.error(request, exc.detail)
        return HttpResponseRedirect(reverse("team"))
    if membership.user_id == request.user.pk:
        messages.success(request, f"You left {tenant.name}.")
        return HttpResponseRedirect(settings.LOGIN_REDIRECT_URL)
    messages.success(request, f"{membership.user.username} is no longer a member of {tenant.name}.")
    return HttpResponseRedirect(reverse("team"))
