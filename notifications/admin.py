"""Admin for notification channels and the delivery log (staff).

Secrets are never shown back: URLs appear masked, signing secrets only once, on the page
that follows creating or rotating one. Changes are service calls, audited like the rest.
"""

from __future__ import annotations

from datetime import UTC

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.template.defaultfilters import pluralize
from django.template.response import TemplateResponse
from django.utils.decorators import method_decorator
from django.utils.html import format_html
from django.views.decorators.debug import sensitive_post_parameters

from portal.core.admin import (
    IndexedDateHierarchyMixin,
    IndexedValuesListFilter,
    ReadOnlyAdminMixin,
    ServiceAdminMixin,
    ShownValuesMixin,
)
from portal.core.crypto import mask
from portal.core.egress import MAX_URL_LENGTH
from portal.core.exceptions import InvalidInput
from portal.core.words import count_of
from tenants.services import slack_webhook_url_check

from . import services
from .choices import EVENT_LABELS, SUBSCRIBABLE_EVENTS, ChannelKind, DeliveryStatus
from .models import Channel, Delivery, DeliveryAttempt

EVENT_CHOICES = [(e, EVENT_LABELS[e]) for e in SUBSCRIBABLE_EVENTS]


class ChannelForm(ShownValuesMixin, forms.ModelForm):
    # A page opened before a lead's (or another admin's) change does not post its old values back
    # (ShownValuesMixin); the services check the shown values again under the channel's lock.
    watched = ("name", "events", "enabled")

    events = forms.MultipleChoiceField(choices=EVENT_CHOICES, required=False,
                                       widget=forms.CheckboxSelectMultiple)
    new_url = forms.URLField(
        required=False, max_length=MAX_URL_LENGTH, assume_scheme="https", label="New URL",
        widget=forms.TextInput(attrs={"autocomplete": "off", "size": 60}),
        help_text="Replaces the URL (shown masked above). For a tenant's Slack channel this is the tenant's "
                  "incoming-webhook URL; the platform channel's comes from PORTAL_PLATFORM_SLACK_WEBHOOK.",
    )

    class Meta:
        model = Channel
        fields = ("name", "events", "enabled")

    def clean_new_url(self) -> str:
        # Asked here, as the service will: refused only in save_model, staff got a message over an emptied form
        # (the URL, name and events they had typed gone).
        url = self.cleaned_data.get("new_url") or ""
        if url:
            check = services.webhook_url_check if self.instance.kind == ChannelKind.WEBHOOK else slack_webhook_url_check
            try:
                check(url)
            except InvalidInput as exc:
                reason = exc.detail.split(": ", 1)[-1]  # the service names its field ("url: …")
                hints = " ".join(t for t in (exc.fields or {}).values() if t and t not in reason)
                raise forms.ValidationError(f"{reason[:1].upper()}{reason[1:]} {hints}".strip()) from None
        return url


class AttemptInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = DeliveryAttempt
    fields = ("number", "started_at", "finished_at", "verdict", "status_code", "error", "retry_after",
              "next_attempt_at", "worker")
    readonly_fields = fields
    extra = 0


@admin.register(Channel)
class ChannelAdmin(ServiceAdminMixin, admin.ModelAdmin):
    form = ChannelForm
    list_display = ("label", "tenant", "kind", "enabled", "health", "url_masked", "event_count")
    list_filter = ("kind", "enabled", "tenant")
    search_fields = ("name", "tenant__slug")
    list_select_related = ("tenant",)
    readonly_fields = ("tenant", "kind", "url_masked", "secret_masked", "health", "created_at")
    actions = ["send_test", "clear_broken", "rotate_secret"]

    def get_fields(self, request, obj=None):
        fields = ["tenant", "kind", "name", "url_masked", "new_url", "events", "enabled", "health"]
        if obj is not None and obj.kind == ChannelKind.WEBHOOK:
            fields.insert(4, "secret_masked")
        if obj is not None and obj.is_platform:
            fields.remove("new_url")
        return fields

    def get_readonly_fields(self, request, obj=None):
        # Only a webhook's name is saved (webhook_update): a Slack channel's edit passes the URL, events and
        # enabled flag, so a Name box there was an edit silently dropped.
        fields = super().get_readonly_fields(request, obj)
        if obj is not None and obj.kind != ChannelKind.WEBHOOK:
            fields = (*fields, "name")
        return fields

    @method_decorator(sensitive_post_parameters("new_url"))  # a bearer secret: starred out of error reports
    def change_view(self, request, object_id, form_url="", extra_context=None):
        return super().change_view(request, object_id, form_url, extra_context)

    def has_add_permission(self, request, *args):
        return False  # leads add webhooks on their notifications page (staff can open any tenant's)

    @admin.display(description="URL")
    def url_masked(self, obj: Channel) -> str:
        return obj.masked_url() or "not set"

    @admin.display(description="signing secret")
    def secret_masked(self, obj: Channel) -> str:
        text = mask(obj.secret) if obj.secret else "—"
        if obj.previous_secret and obj.previous_secret_expires_at:
            text += f" (previous secret also signs until {obj.previous_secret_expires_at:%Y-%m-%d %H:%M} UTC)"
        return text

    @admin.display(description="status")
    def health(self, obj: Channel) -> str:
        if obj.is_broken:
            # format_html escapes its arguments to strings first: the time is formatted here (a format spec
            # in the template failed on that string, a 500 for the whole list), in UTC as the page says.
            since = obj.broken_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
            return format_html('<strong style="color:#ba2121">broken: {}</strong> (since {})', obj.broken_error, since)
        return "ok" if obj.enabled else "disabled"

    @admin.display(description="events")
    def event_count(self, obj: Channel) -> int:
        return len(obj.events)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        changed = set(form.changed_data)
        # Only what this admin changed, if still as the page showed it (checked under the channel's lock).
        expected = form.shown(changed & set(form.watched))
        if obj.kind == ChannelKind.WEBHOOK:
            services.webhook_update(
                actor=request.user, channel=obj,
                name=data["name"] if "name" in changed else None,
                events=data["events"] if "events" in changed else None,
                enabled=data["enabled"] if "enabled" in changed else None,
                url=data["new_url"] or None, expected=expected,
            )
            return
        if obj.is_platform:
            if changed & {"events", "enabled"}:
                services.platform_channel_update(
                    actor=request.user, channel=obj,
                    events=data["events"] if "events" in changed else None,
                    enabled=data["enabled"] if "enabled" in changed else None, expected=expected,
                )
            return
        if data.get("new_url") or changed & {"events", "enabled"}:
            # One service call, one transaction: the tenant's URL and the channel's settings, or neither.
            services.slack_subscriptions_update(
                actor=request.user, tenant=obj.tenant, url=data.get("new_url") or None,
                events=data["events"] if "events" in changed else None,
                enabled=data["enabled"] if "enabled" in changed else None, expected=expected,
            )

    def delete_model(self, request, obj):
        services.channel_delete(actor=request.user, channel=obj)

    def delete_queryset(self, request, queryset):
        # Each refusal (the platform channel) is a message; the other selected channels still go.
        super().delete_queryset(request, queryset.select_related("tenant"))

    @admin.action(description="Send a test message")
    def send_test(self, request, queryset):
        for channel in queryset.select_related("tenant"):
            delivery = self.run_service(request, services.channel_send_test, actor=request.user, channel=channel)
            if delivery is not None:
                self.message_user(request, f"Test message to {channel.label} queued (delivery #{delivery.pk}).")

    @admin.action(description="Clear the broken flag (after fixing the receiver)")
    def clear_broken(self, request, queryset):
        cleared, not_broken = [], 0
        for channel in queryset.select_related("tenant"):
            result = self.run_service(request, services.channel_clear_broken, actor=request.user, channel=channel)
            if result is None:
                continue  # refused: run_service reported why
            channel, was_broken = result
            if was_broken:
                cleared.append(channel)
            else:
                not_broken += 1
        # Say what was done: which flags were cleared, what had none, and which of those cleared still
        # send nothing (disabled), rather than "the channels send again" whatever the selection held.
        if cleared:
            names = ", ".join(c.label for c in cleared)
            self.message_user(request, f"Cleared the broken flag of {len(cleared)} channel{pluralize(len(cleared))}: "
                                       f"{names}.", messages.SUCCESS)
            disabled = [c.label for c in cleared if not c.enabled]
            if disabled:
                self.message_user(request, f"Still disabled, so nothing is sent to: {', '.join(disabled)}.",
                                  messages.WARNING)
        if not_broken and cleared:
            self.message_user(request, f"{not_broken} selected channel{pluralize(not_broken)} "
                                       f"{pluralize(not_broken, 'was,were')} not broken (nothing to clear).")
        elif not_broken:
            self.message_user(request, "None of the selected channels was broken; nothing was cleared.",
                              messages.WARNING)

    @admin.action(description="Rotate the signing secret (signed webhooks)")
    def rotate_secret(self, request, queryset):
        webhooks = list(queryset.filter(kind=ChannelKind.WEBHOOK).select_related("tenant"))
        if not webhooks:
            self.message_user(request, "Only signed webhooks have a signing secret.", messages.WARNING)
            return None
        if request.POST.get("post") != "yes":
            # Asked first, as delete_selected asks: the tenants' receivers' old secrets start expiring (or stop at
            # once) for every webhook selected.
            context = {
                **self.admin_site.each_context(request),
                "title": "Rotate signing secrets?",
                "opts": self.model._meta,
                "webhooks": [(channel, services.secret_version(channel)) for channel in webhooks],
                "overlap_hours": services.secret_overlap_hours(),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(request, "admin/notifications/channel/rotate_confirm.html", context)
        rotated = []
        for channel in webhooks:
            # The version the confirmation showed: its second post (a double click) is refused for each webhook
            # it rotated already, rather than rotating it again (which ended its old secret's overlap at once).
            result = self.run_service(request, services.webhook_rotate_secret, actor=request.user, channel=channel,
                                      expected_version=request.POST.get(f"version-{channel.pk}"))
            if result is not None:
                rotated.append(result)
        if not rotated:
            return None  # every one refused: run_service said why
        context = {
            **self.admin_site.each_context(request),
            "title": "New signing secrets",
            "opts": self.model._meta,
            "rotated": rotated,
        }
        # Shown once, in this response only (never stored in a message or the session).
        return TemplateResponse(request, "admin/notifications/channel/secrets.html", context)


@admin.register(Delivery)
class DeliveryAdmin(IndexedDateHierarchyMixin, ReadOnlyAdminMixin, ServiceAdminMixin, admin.ModelAdmin):
    list_display = ("created_at", "event", "channel_label", "tenant", "status", "attempts", "last_status_code",
                    "last_error", "delivered_at")
    list_filter = ("status", "kind", ("event", IndexedValuesListFilter), "tenant")
    search_fields = ("summary", "key", "message_id", "last_error")
    list_select_related = ("tenant",)
    date_hierarchy = "created_at"
    readonly_fields = ("key", "event", "source_event", "channel_label", "kind", "tenant", "summary", "status",
                       "attempts", "next_attempt_at", "lease_until", "last_attempt_at", "last_status_code",
                       "last_error", "delivered_at", "message_id", "payload", "created_at")
    fields = readonly_fields
    inlines = [AttemptInline]
    actions = ["retry_now"]

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.action(description="Retry now (failed or skipped deliveries)")
    def retry_now(self, request, queryset):
        done = 0
        for delivery in queryset.filter(status__in=[DeliveryStatus.FAILED, DeliveryStatus.SKIPPED,
                                                    DeliveryStatus.RETRYING]):
            if self.run_service(request, services.delivery_requeue, actor=request.user, delivery=delivery):
                done += 1
        self.message_user(request, f"Queued {count_of(done, 'delivery', 'deliveries')} again.",
                          messages.SUCCESS if done else messages.WARNING)
