"""A lead's notification pages: Slack and signed webhooks for the current tenant, and the delivery log.

Only the tenant's lead (and staff) may see or change them; the services decide again under the team
lock (a lead demoted or removed while a request runs is refused: 403). Every object is looked up inside
the user's scope, so another tenant's channel or delivery is a 404. Secrets: the Slack URL
is shown masked, a signing secret only in the response that created or rotated it.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import add_never_cache_headers
from django.views.decorators.debug import sensitive_post_parameters
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from portal.core.crypto import mask
from portal.core.exceptions import DomainError, InvalidInput, QuotaExceeded
from tenants.choices import Role
from tenants.services import tenant_slack_webhook_set
from tenants.views import portal_view, render_page

from . import selectors, services
from .choices import EVENT_LABELS, ChannelKind
from .forms import DeliveryFilterForm, EventsForm, SlackUrlForm, WebhookEditForm, WebhookForm
from .models import Channel

__all__ = [
    "settings_page",
    "slack_url",
    "slack_events",
    "slack_test",
    "webhook_create",
    "webhook_edit",
    "webhook_rotate",
    "webhook_delete",
    "channel_test",
    "channel_clear",
    "delivery_log",
    "delivery_retry",
]

PAGE_SIZE = 50


def _lead_tenant(request):
    """The current tenant, if the user leads it (or is staff); else 403."""
    portal = request.portal
    if portal.tenant is None or not (request.user.is_staff or portal.role == Role.LEAD):
        raise PermissionDenied("Only the tenant's lead manages its notifications.")
    return portal.tenant


def _channel(request, tenant, pk: int, kind: str | None = None) -> Channel:
    qs = selectors.channels_for_user(user=request.user, tenant=tenant)
    if kind:
        qs = qs.filter(kind=kind)
    channel = qs.filter(pk=pk).first()
    if channel is None:
        raise Http404("No such channel.")
    return channel


def _back() -> HttpResponseRedirect:
    return HttpResponseRedirect(reverse("notifications:settings"))


def _settings_context(request, tenant, **extra):
    channels = list(selectors.channels_for_user(user=request.user, tenant=tenant))
    slack = next((c for c in channels if c.kind == ChannelKind.SLACK), None)
    webhooks = [c for c in channels if c.kind == ChannelKind.WEBHOOK]
    slack_events = slack.events if slack is not None else list(EVENT_LABELS)
    tests = selectors.latest_tests(channels)
    for channel in channels:
        channel.last_test = tests.get(channel.pk)  # what its "Send test message" came to, shown beside the button
    context = {
        "tenant": tenant,
        "slack": slack,
        "slack_url_masked": mask(tenant.slack_webhook_url, keep=6),
        "slack_form": SlackUrlForm(),
        "events_form": EventsForm(initial={"events": slack_events,
                                           "enabled": slack.enabled if slack is not None else True}),
        "webhooks": [
            (c, WebhookEditForm(initial={"name": c.name, "events": c.events, "enabled": c.enabled},
                                prefix=f"w{c.pk}"))
            for c in webhooks
        ],
        "webhook_form": WebhookForm(),
        "webhook_cap": services.max_webhooks(),
        "event_labels": EVENT_LABELS,
        "recent": selectors.deliveries_for_user(user=request.user, tenant=tenant)[:10],
    }
    context.update(extra)
    return context


def _error(request, exc: DomainError):
    if exc.status == 403:  # the service decided again, under the team lock: a lead demoted meanwhile is refused
        raise PermissionDenied(exc.detail)
    messages.error(request, exc.detail)
    return _back()


@require_GET
@portal_view
def settings_page(request):
    tenant = _lead_tenant(request)
    return render_page(request, "notifications/settings.html", _settings_context(request, tenant))


@sensitive_post_parameters()  # the URL is a bearer secret: starred out of error reports
@require_POST
@portal_view
def slack_url(request):
    tenant = _lead_tenant(request)
    form = SlackUrlForm(request.POST)
    if not form.is_valid():
        return render_page(request, "notifications/settings.html",
                           _settings_context(request, tenant, slack_form=form), status=400)
    url = "" if form.cleaned_data["clear"] else form.cleaned_data["url"]
    try:
        tenant_slack_webhook_set(actor=request.user, tenant=tenant, url=url)
    except InvalidInput as exc:
        # Refused (a private address, a control character): why, beside what was typed, in the page's words
        # (the service names the model's field, "slack_webhook_url: …").
        reason = exc.detail.split(": ", 1)[-1]
        reason = reason[:1].upper() + reason[1:]
        hints = " ".join(text for text in (exc.fields or {}).values() if text and text not in reason)
        form.add_error("url", f"{reason} {hints}".strip())
        return render_page(request, "notifications/settings.html",
                           _settings_context(request, tenant, slack_form=form), status=400)
    except DomainError as exc:
        return _error(request, exc)
    messages.success(request, "Slack webhook removed." if not url else
                     "Slack webhook saved. Send a test message to check it.")
    return _back()


@require_POST
@portal_view
def slack_events(request):
    tenant = _lead_tenant(request)
    form = EventsForm(request.POST)
    if not form.is_valid():
        return render_page(request, "notifications/settings.html",
                           _settings_context(request, tenant, events_form=form), status=400)
    try:
        services.slack_subscriptions_update(actor=request.user, tenant=tenant, events=form.cleaned_data["events"],
                                            enabled=form.cleaned_data["enabled"])
    except DomainError as exc:
        return _error(request, exc)
    messages.success(request, "Slack events saved.")
    return _back()


@require_POST
@portal_view
def slack_test(request):
    tenant = _lead_tenant(request)
    channel = services.slack_channel_ensure(tenant)
    if channel is None:
        messages.error(request, "Set a Slack webhook URL first.")
        return _back()
    return _send_test(request, channel)


def _send_test(request, channel: Channel):
    try:
        delivery = services.channel_send_test(actor=request.user, channel=channel)
    except DomainError as exc:
        return _error(request, exc)
    messages.success(request, f"Test message queued (delivery #{delivery.pk}). It is tried for up to "
                              f"{services.test_retry_seconds():.0f} seconds; reload this page for the receiver's "
                              "answer.")
    return _back()


@require_POST
@portal_view
def channel_test(request, pk: int):
    tenant = _lead_tenant(request)
    return _send_test(request, _channel(request, tenant, pk))


@require_POST
@portal_view
def channel_clear(request, pk: int):
    tenant = _lead_tenant(request)
    try:
        channel, cleared = services.channel_clear_broken(actor=request.user, channel=_channel(request, tenant, pk))
    except DomainError as exc:
        return _error(request, exc)
    if not cleared:
        messages.info(request, "The channel was not broken; nothing to clear.")
    elif not channel.enabled:
        messages.success(request, "The broken flag is cleared; the channel is disabled, so nothing is sent until "
                                  "it is enabled.")
    else:
        messages.success(request, "The channel sends again.")
    return _back()


@sensitive_post_parameters()  # the URL is a bearer secret: starred out of error reports
@require_POST
@portal_view
def webhook_create(request):
    tenant = _lead_tenant(request)
    form = WebhookForm(request.POST)
    if not form.is_valid():
        return render_page(request, "notifications/settings.html",
                           _settings_context(request, tenant, webhook_form=form), status=400)
    try:
        channel, secret = services.webhook_create(actor=request.user, tenant=tenant, url=form.cleaned_data["url"],
                                                  name=form.cleaned_data["name"], events=form.cleaned_data["events"])
    except InvalidInput as exc:
        # Refused input (a private address, a control character): say why next to what was typed.
        for field, message in (exc.fields or {}).items():
            form.add_error(field if field in form.fields else None, message)
        form.add_error(None, exc.detail)
        return render_page(request, "notifications/settings.html",
                           _settings_context(request, tenant, webhook_form=form), status=400)
    except QuotaExceeded as exc:
        # The tenant has as many webhooks as it may: said beside the form, with what was typed still in it.
        form.add_error(None, exc.detail)
        return render_page(request, "notifications/settings.html",
                           _settings_context(request, tenant, webhook_form=form), status=exc.status)
    except DomainError as exc:
        return _error(request, exc)
    # The secret is shown in this response only; it is stored encrypted and never displayed again.
    return _secret_page(request, _settings_context(request, tenant, new_secret=secret, new_secret_channel=channel))


def _secret_page(request, context):
    """The settings page carrying a signing secret: no cache (browser, proxy) may keep a copy."""
    response = render_page(request, "notifications/settings.html", context)
    add_never_cache_headers(response)
    return response


@sensitive_post_parameters()  # the URL is a bearer secret: starred out of error reports
@require_POST
@portal_view
def webhook_edit(request, pk: int):
    tenant = _lead_tenant(request)
    channel = _channel(request, tenant, pk, ChannelKind.WEBHOOK)
    form = WebhookEditForm(request.POST, prefix=f"w{channel.pk}")
    if not form.is_valid():
        return _webhook_edit_refused(request, tenant, channel, form)
    try:
        services.webhook_update(actor=request.user, channel=channel, name=form.cleaned_data["name"],
                                url=form.cleaned_data["url"] or None, events=form.cleaned_data["events"],
                                enabled=form.cleaned_data["enabled"])
    except InvalidInput as exc:
        for field, message in (exc.fields or {}).items():
            form.add_error(field if field in form.fields else None, message)
        form.add_error(None, exc.detail)
        return _webhook_edit_refused(request, tenant, channel, form)
    except DomainError as exc:
        return _error(request, exc)
    messages.success(request, "Webhook saved.")
    return _back()


def _webhook_edit_refused(request, tenant, channel: Channel, form: WebhookEditForm):
    """The settings page with this webhook's form open as it was typed, the reasons beside its fields."""
    context = _settings_context(request, tenant, open_channel=channel.pk)
    context["webhooks"] = [(c, form if c.pk == channel.pk else f) for c, f in context["webhooks"]]
    return render_page(request, "notifications/settings.html", context, status=400)


@require_http_methods(["GET", "POST"])
@portal_view
def webhook_rotate(request, pk: int):
    """GET asks for confirmation (a page that works without JavaScript); POST with confirm rotates.

    The receiver's old secret starts expiring (or stops at once): a POST without the confirmation (a settings
    page still open from before, whose button rotated in one click) is asked the question too."""
    tenant = _lead_tenant(request)
    channel = _channel(request, tenant, pk, ChannelKind.WEBHOOK)
    if request.method == "GET" or request.POST.get("confirm") != "yes":
        previous_until = channel.previous_secret_expires_at if channel.previous_secret else None
        return render_page(request, "notifications/rotate_confirm.html", {
            "tenant": tenant, "channel": channel, "overlap_hours": services.secret_overlap_hours(),
            "version": services.secret_version(channel),
            "previous_until": previous_until if previous_until and previous_until > timezone.now() else None,
        })
    try:
        # The version the confirmation showed: its second post (a double click) is refused, not a second rotation.
        channel, secret = services.webhook_rotate_secret(actor=request.user, channel=channel,
                                                         expected_version=request.POST.get("version"))
    except DomainError as exc:
        return _error(request, exc)
    return _secret_page(request, _settings_context(request, tenant, new_secret=secret, new_secret_channel=channel,
                                                   rotated=True))


@require_POST
@portal_view
def webhook_delete(request, pk: int):
    tenant = _lead_tenant(request)
    try:
        services.channel_delete(actor=request.user, channel=_channel(request, tenant, pk, ChannelKind.WEBHOOK))
    except DomainError as exc:
        return _error(request, exc)
    messages.success(request, "Webhook deleted; its deliveries stay in the log.")
    return _back()


@require_GET
@portal_view
def delivery_log(request):
    tenant = _lead_tenant(request)
    form = DeliveryFilterForm(request.GET)
    status = form.cleaned_data["status"] if form.is_valid() else ""
    qs = selectors.deliveries_for_user(user=request.user, tenant=tenant, status=status or None)
    page = Paginator(qs, PAGE_SIZE).get_page(request.GET.get("page"))
    return render_page(request, "notifications/deliveries.html",
                       {"tenant": tenant, "page": page, "filter_form": form, "status": status})


@require_POST
@portal_view
def delivery_retry(request, pk: int):
    tenant = _lead_tenant(request)
    delivery = selectors.deliveries_for_user(user=request.user, tenant=tenant).filter(pk=pk).first()
    if delivery is None:
        raise Http404("No such delivery.")
    try:
        services.delivery_requeue(actor=request.user, delivery=delivery)
    except DomainError as exc:
        if exc.status == 403:
            raise PermissionDenied(exc.detail)
        messages.error(request, exc.detail)
    else:
        messages.success(request, f"Delivery #{delivery.pk} queued again.")
    return HttpResponseRedirect(reverse("notifications:deliveries"))
