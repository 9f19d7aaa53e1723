"""Admin for tenants, memberships, quotas, API tokens and user accounts: every save goes through
the audited services.

Quota edits — on the quota's page, inline on the tenant, in place on the quota list, or in
bulk from the list's action — all end in ``quota_update`` / ``quota_bulk_update``, which lock
the rows bookings lock and write an audit row (actor, old → new) per quota. Lowering a quota
below what the tenant has already booked first shows the affected reservations and asks to
confirm; existing bookings are never cancelled by a quota change. Turning a tenant's burst off on its page lowers
every quota's limit (max + burst → max) and asks the same way. The quota's page carries the
version it was opened at (``QuotaAdminForm``): saved after another change to that quota, it is
refused with a form error, never applied over the newer numbers. The list's in-place edits post the
numbers each row showed (``QuotaListForm``) and are refused the same way when a row has changed since;
the tenant page's quota rows (``QuotaInlineForm``) write only the numbers the admin changed, version-checked.
"""

from __future__ import annotations

import functools
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import csrf_protect_m
from django.contrib.admin.utils import unquote
from django.contrib.admin.widgets import ForeignKeyRawIdWidget
from django.contrib.auth import get_user_model, update_session_auth_hash
from django.contrib.auth.admin import GroupAdmin as DjangoGroupAdmin
from django.contrib.auth.admin import UserAdmin as DjangoUserAdmin
from django.contrib.auth.models import Group
from django.core.exceptions import ObjectDoesNotExist, PermissionDenied, ValidationError
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.decorators import method_decorator
from django.utils.html import format_html
from django.utils.text import Truncator
from django.views.decorators.debug import sensitive_post_parameters
from simple_history.admin import SimpleHistoryAdmin

from portal.core.admin import (
    ServiceAdminMixin,
    ServiceTransactionMixin,
    ShownValuesMixin,
    StaffAdminMixin,
    admin_hooks,
)
from portal.core.crypto import mask
from portal.core.egress import MAX_URL_LENGTH
from portal.core.exceptions import DomainError, InvalidInput, InvalidState
from portal.core.words import count_of

from . import services
from .choices import Role
from .forms import LockoutAdminAuthenticationForm
from .models import ApiToken, Membership, Quota, Tenant
from .selectors import quota_version

# /admin/login/ counts failures and locks like /accounts/login/ (one lock for both): Django's own admin
# sign-in form would take unlimited guesses at the staff accounts' passwords.
admin.site.login_form = LockoutAdminAuthenticationForm

QUOTA_FIELDS = services.QUOTA_FIELDS
CONFIRM_FIELD = "_confirm_lowering"


# --- the lowering warning --------------------------------------------------------------------


def _lowers(old: Quota, new: dict[str, Any]) -> bool:
    if new.get("max_nodes", old.max_nodes) < old.max_nodes:
        return True
    if new.get("burst_nodes", old.burst_nodes) < old.burst_nodes:
        return True
    hours = new.get("max_duration_hours", old.max_duration_hours)
    return hours is not None and (old.max_duration_hours is None or hours < old.max_duration_hours)


def lowering_review(request, model_admin, changes: list[tuple[Quota, dict[str, Any]]], *, burst_off: bool = False):
    """Return a confirmation page when changes lower quotas below existing bookings, else None.

    burst_off: the same save turns the tenant's burst off, which lowers each of its quotas' limits (max + burst
    → max) as lowering the numbers does; changes then lists every quota of the tenant.

    The page lists the affected reservations and re-posts the very same form data with
    ``_confirm_lowering=yes``, so confirming saves exactly what was reviewed. (A new Slack URL typed in the same
    form goes back in it too, to the admin who just typed it, as any re-shown form does; admin pages are
    never_cache, so no browser or proxy keeps the page.)
    """
    if request.POST.get(CONFIRM_FIELD) == "yes":
        return None
    finder = admin_hooks.get("quota_conflicts")
    if finder is None:
        return None
    groups = []
    for old, values in changes:
        new = {f: values.get(f, getattr(old, f)) for f in QUOTA_FIELDS}
        cuts_burst = burst_off and old.tenant.burst_enabled and old.burst_nodes > 0
        if not (_lowers(old, new) or cuts_burst):
            continue
        conflicts = finder(quota=old, **new, **({"burst_enabled": False} if burst_off else {}))
        if conflicts:
            groups.append({"quota": old, "old": {f: getattr(old, f) for f in QUOTA_FIELDS}, "new": new,
                           "conflicts": conflicts, "burst_off": cuts_burst})
    if not groups:
        return None
    post_items = [
        (key, value) for key in request.POST for value in request.POST.getlist(key)
        if key not in ("csrfmiddlewaretoken", CONFIRM_FIELD)
    ]
    context = {
        **model_admin.admin_site.each_context(request),
        "title": ("Turn burst off below what is booked?" if any(g["burst_off"] for g in groups)
                  else "Lower a quota below what is booked?"),
        "opts": Quota._meta,
        "groups": groups,
        "burst_off": any(g["burst_off"] for g in groups),
        "post_items": post_items,
        "confirm_field": CONFIRM_FIELD,
        "back_url": request.get_full_path(),
    }
    return TemplateResponse(request, "admin/tenants/quota/confirm_lowering.html", context)


STALE_QUOTA_FORM = ("This quota was changed since you opened it (by another admin or the API): the numbers below "
                    "are its current ones. Make your change again on them and save.")


class QuotaAdminForm(forms.ModelForm):
    """The quota's page carries the version it was rendered from (selectors.quota_version): saved after
    someone else's save, it is refused with a form error instead of writing the numbers it showed over
    theirs. quota_update checks it again under the row lock, for a save that lands in between."""

    version = forms.CharField(widget=forms.HiddenInput, required=False)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["version"].initial = quota_version(self.instance)

    def clean(self):
        cleaned = super().clean()
        # The instance is the row as read for this POST: a version other than its own is a stale form. A form
        # rendered before the version existed (or a hand-made POST without one) is refused the same way.
        if self.instance.pk is not None and self.checks_version() and cleaned.get("version") != quota_version(
                self.instance):
            self.data = self.data.copy()
            self.data[self.add_prefix("version")] = quota_version(self.instance)  # re-rendered as current
            for name in QUOTA_FIELDS:  # ... with the current numbers, to redo the change on
                if name in self.fields:
                    value = getattr(self.instance, name)
                    self.data[self.add_prefix(name)] = "" if value is None else str(value)
                    self.data[self.add_initial_prefix(name)] = self.data[self.add_prefix(name)]
            raise forms.ValidationError(STALE_QUOTA_FORM, code="stale")
        return cleaned

    def checks_version(self) -> bool:
        return True

    def clean_max_duration_hours(self):
        return _clean_duration(self)


class QuotaInlineForm(QuotaAdminForm):
    """A quota row on the tenant page. Each number also posts (hidden) what the page showed, so a row the
    admin left alone is not written (a stale page would otherwise post its old numbers back over a newer
    edit), and a row they changed is checked against its version."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in QUOTA_FIELDS:
            if name in self.fields:
                self.fields[name].show_hidden_initial = True

    def numbers_changed(self) -> list[str]:
        return [name for name in QUOTA_FIELDS if name in self.changed_data]

    def checks_version(self) -> bool:
        return bool(self.numbers_changed())


class QuotaListForm(forms.ModelForm):
    """A row of the quota list's in-place edits: each number also posts (hidden) the value the page showed, so
    only what the admin changed counts as changed (Django's show_hidden_initial), and a row changed by
    someone else since the page was opened is told apart (QuotaAdmin._save_list_edits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in QUOTA_FIELDS:
            if name in self.fields:
                self.fields[name].show_hidden_initial = True

    def clean_max_duration_hours(self):
        return _clean_duration(self)

    def shown(self) -> dict[str, Any]:
        """The numbers the page showed for this row (its hidden initial values; None where one is missing)."""
        values = {}
        for name in QUOTA_FIELDS:
            if name in self.fields:
                field = self.fields[name]
                raw = field.hidden_widget().value_from_datadict(self.data, self.files, self.add_initial_prefix(name))
                try:
                    values[name] = field.to_python(raw)
                except ValidationError:
                    values[name] = None
        return values


def _clean_duration(form) -> int | None:
    # Asked here, as the quota services will: 0 was refused by the database's constraint as "Quota numbers cannot
    # be negative.", and more than the API takes was saved.
    hours = form.cleaned_data.get("max_duration_hours")
    if form.instance.pk is not None and hours == form.instance.max_duration_hours:
        # Saved before the rule and left as it is: it stands (the services judge only a new value), and must not
        # refuse a change of the quota's other numbers, or of another row on the same page.
        return hours
    why = services.quota_duration_error(hours)
    if why:
        raise forms.ValidationError(why)
    return hours


def _quota_values(form) -> dict[str, Any]:
    return {f: form.cleaned_data[f] for f in QUOTA_FIELDS if f in form.cleaned_data}


# --- inlines -------------------------------------------------------------------------------


class MembershipInlineForm(ShownValuesMixin, forms.ModelForm):
    watched = ("role",)

    def clean_user(self):
        user = self.cleaned_data["user"]
        # membership_create takes active accounts only: refused here, the page saves nothing, instead of the
        # tenant's own fields being committed before the refusal. A member disabled since stays listed.
        if user is not None and not user.is_active and (self.instance.pk is None or "user" in self.changed_data):
            raise forms.ValidationError("This account is disabled; only an active account can be added.")
        return user


class _KnownUserWidget(ForeignKeyRawIdWidget):
    """The raw-id user box, naming a user the formset already loaded without a query of its own per row."""

    known: dict[str, Any] = {}

    def label_and_url_for_value(self, value):
        user = self.known.get(str(value))
        if user is None:
            return super().label_and_url_for_value(value)
        return Truncator(user).words(14), reverse(f"{self.admin_site.name}:auth_user_change", args=(user.pk,))


class MembershipFormSet(BaseInlineFormSet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        known = {str(form.instance.user_id): form.instance.user for form in self.initial_forms}
        for form in self.forms:
            widget = form.fields["user"].widget
            if isinstance(widget, _KnownUserWidget):
                widget.known = known


class QuotaFormSet(BaseInlineFormSet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        choices = list(self.form.base_fields["pool"].choices) if "pool" in self.form.base_fields else None
        for form in self.forms if choices is not None else ():
            form.fields["pool"].widget.choices = choices  # the pools listed once, not once per row


class MembershipInline(StaffAdminMixin, admin.TabularInline):
    model = Membership
    form = MembershipInlineForm
    formset = MembershipFormSet
    extra = 0
    fields = ("user", "role", "created_at")
    readonly_fields = ("created_at",)
    raw_id_fields = ("user",)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("user", "tenant")  # each row's name: user @ tenant

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "user":
            kwargs["widget"] = _KnownUserWidget(db_field.remote_field, self.admin_site, using=kwargs.get("using"))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class QuotaInline(StaffAdminMixin, admin.TabularInline):
    model = Quota
    form = QuotaInlineForm
    formset = QuotaFormSet
    extra = 0
    fields = ("pool", "max_nodes", "burst_nodes", "max_duration_hours", "updated_at", "version")
    readonly_fields = ("updated_at",)
    show_change_link = True

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("tenant", "pool")  # each row's name: tenant/pool


# --- tenants -------------------------------------------------------------------------------


class TenantForm(ShownValuesMixin, forms.ModelForm):
    """Everything but the secrets: the Slack URL is set by the lead (or below) and never shown back."""

    watched = ("slug", "name", "burst_enabled", "storage_quota_tib", "vlan_id", "cidr")

    new_slack_webhook_url = forms.URLField(
        required=False, max_length=MAX_URL_LENGTH, assume_scheme="https",
        widget=forms.TextInput(attrs={"autocomplete": "off", "size": 60}),
        help_text="Paste a new Slack incoming-webhook URL to replace the current one (shown masked above).",
    )
    clear_slack_webhook_url = forms.BooleanField(required=False, label="Remove the Slack webhook")

    class Meta:
        model = Tenant
        fields = ("slug", "name", "burst_enabled", "storage_quota_tib", "vlan_id", "cidr")

    def clean_cidr(self) -> str:
        cidr = self.cleaned_data.get("cidr") or ""
        try:  # as tenant_create / tenant_update will; refused there, staff got an emptied form back
            services.tenant_network_check(cidr)
        except InvalidInput as exc:
            raise forms.ValidationError(exc.fields.get("cidr") or exc.detail) from None
        return cidr

    def clean_new_slack_webhook_url(self) -> str:
        # Asked here, as tenant_slack_webhook_set will: refused after tenant_update, the rest was already saved.
        url = self.cleaned_data.get("new_slack_webhook_url") or ""
        if url:
            try:
                services.slack_webhook_url_check(url)
            except InvalidInput as exc:
                raise forms.ValidationError(exc.detail) from None
        return url


# What names an inline row (a membership's user, a quota's pool): the services change only the rest.
_ROW_KEYS = {
    Membership: ("user", "To give a membership to another user, delete its row and add a new one."),
    Quota: ("pool", "To give the tenant a quota in another pool, delete its row and add a new one."),
}


def _refuse_changed_key(form) -> None:
    """Refuse an inline form that changes what names an existing row: no service makes that change, so
    it would be dropped while the page said it was saved."""
    field, message = _ROW_KEYS[type(form.instance)]
    if form.instance.pk and field in getattr(form, "changed_data", ()):
        raise InvalidInput(message, fields={field: f"Cannot change on an existing {form.instance._meta.verbose_name}."})


@admin.register(Tenant)
class TenantAdmin(ServiceAdminMixin, admin.ModelAdmin):
    form = TenantForm
    list_display = ("slug", "name", "burst_enabled", "storage_quota_tib", "vlan_id", "cidr", "slack", "links")
    search_fields = ("slug", "name")
    list_filter = ("burst_enabled",)
    readonly_fields = ("slack_webhook", "links", "created_at")
    inlines = [MembershipInline, QuotaInline]

    def get_fieldsets(self, request, obj=None):
        main = ("slug", "name", "burst_enabled", "storage_quota_tib", "vlan_id", "cidr")
        if obj is None:
            return [(None, {"fields": main})]
        return [
            (None, {"fields": main}),
            ("Slack", {"fields": ("slack_webhook", "new_slack_webhook_url", "clear_slack_webhook_url")}),
            ("More", {"fields": ("links", "created_at")}),
        ]

    def has_delete_permission(self, request, obj=None):
        return False  # tenants keep their history; remove members and quotas instead

    @admin.display(description="Slack")
    def slack(self, obj: Tenant) -> str:
        return "set" if obj.slack_webhook_url else "—"

    @admin.display(description="Slack webhook URL")
    def slack_webhook(self, obj: Tenant) -> str:
        return mask(obj.slack_webhook_url, keep=6) or "not set"

    @admin.display(description="See also")
    def links(self, obj: Tenant) -> str:
        if obj.pk is None:
            return "—"
        audit = reverse("admin:core_auditlog_changelist") + f"?tenant_id={obj.pk}"
        return format_html('<a href="{}">Audit log</a>', audit)

    @method_decorator(sensitive_post_parameters("new_slack_webhook_url"))  # a bearer secret: out of error reports
    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        if request.method == "POST" and object_id:
            try:
                # The services commit one by one (durable), so the page cannot be one transaction:
                # refuse what a service would refuse before the first write, not half-way through.
                self._check_inlines(request, object_id)
            except DomainError as exc:
                self.message_user(request, exc.detail, messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
            review = self._review_inline_quotas(request, object_id)
            if review is not None:
                return review
        return super().changeform_view(request, object_id, form_url, extra_context)

    def _changeform_view(self, request, object_id, form_url, extra_context):
        # The services commit one by one (durable, see changeform_view): a refusal after the first write leaves
        # what came before saved. Say so, and what, instead of only the refusal (which read as "nothing saved").
        request._tenant_page_saved, request._tenant_page_saving = [], ""
        try:
            return super()._changeform_view(request, object_id, form_url, extra_context)
        except DomainError as exc:
            saved = request._tenant_page_saved
            if not saved:
                raise  # nothing written: the refusal alone is the truth (ServiceTransactionMixin shows it)
            self.message_user(
                request, f"This page was saved only in part. Saved: {'; '.join(saved)}. Not saved: "
                         f"{request._tenant_page_saving or 'the rest'} ({exc.detail.rstrip('.')}), nor anything after "
                         "it on the page. Reload the page to see what stands and make the rest of your change again.",
                messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    @staticmethod
    def _saving(request, what: str, fn, /, **kwargs):
        """Run one service call of the page's save, noting what it saves for the partial-save message."""
        request._tenant_page_saving = what
        result = fn(**kwargs)
        if hasattr(request, "_tenant_page_saved"):  # set by _changeform_view
            request._tenant_page_saved.append(what)
        return result

    def _check_inlines(self, request, object_id) -> None:
        obj = self.get_object(request, object_id)
        if obj is None:
            return
        for inline in self.get_inline_instances(request, obj):
            FormSet = inline.get_formset(request, obj)
            formset = FormSet(request.POST, request.FILES, instance=obj, prefix=FormSet.get_default_prefix())
            if not formset.is_valid():
                return  # the normal view shows the errors
            for form in formset.forms:
                if getattr(form, "cleaned_data", None) and not formset._should_delete_form(form):
                    _refuse_changed_key(form)
            if not isinstance(inline, MembershipInline):
                continue
            leads = set(Membership.objects.filter(tenant=obj, role=Role.LEAD).values_list("pk", flat=True))
            had_lead, new_leads = bool(leads), 0
            for form in formset.forms:
                if not getattr(form, "cleaned_data", None):
                    continue
                pk, deleting = form.instance.pk, formset._should_delete_form(form)
                is_lead = not deleting and form.cleaned_data.get("role") == Role.LEAD
                if pk:
                    (leads.add if is_lead else leads.discard)(pk)
                elif is_lead:
                    new_leads += 1
            if had_lead and not leads and not new_leads:
                raise InvalidState("This change would take away the tenant's last lead; make another member "
                                   "lead first. Nothing was saved.")

    def _review_inline_quotas(self, request, object_id):
        obj = self.get_object(request, object_id)
        if obj is None:
            return None
        # Burst turned off by this admin (the box shown ticked, posted unticked): every quota's limit drops.
        form = self.get_form(request, obj, change=True)(request.POST, request.FILES, instance=obj)
        burst_off = (obj.burst_enabled and "burst_enabled" in form.changed_data
                     and not form["burst_enabled"].data)
        changes = []
        for inline in self.get_inline_instances(request, obj):
            if not isinstance(inline, QuotaInline):
                continue
            FormSet = inline.get_formset(request, obj)
            formset = FormSet(request.POST, request.FILES, instance=obj, prefix=FormSet.get_default_prefix())
            if not formset.is_valid():
                return None  # the normal view shows the errors
            for form in formset.forms:
                if form.instance.pk and form.numbers_changed() and not formset._should_delete_form(form):
                    changes.append((Quota.objects.select_related("tenant", "pool").get(pk=form.instance.pk),
                                    {f: form.cleaned_data[f] for f in form.numbers_changed()}))
        if burst_off:  # the quotas the inline rows leave alone are lowered too
            listed = {quota.pk for quota, _ in changes}
            changes += [(quota, {}) for quota in Quota.objects.select_related("tenant", "pool")
                        .filter(tenant=obj).exclude(pk__in=listed).order_by("pool__name")]
        return lowering_review(request, self, changes, burst_off=burst_off)

    def save_model(self, request, obj, form, change):
        data = {f: form.cleaned_data[f] for f in TenantForm.Meta.fields if f in form.cleaned_data}
        if change:
            changed = {k: data[k] for k in form.changed_data if k in data}
            if changed:
                labels = ", ".join(str(form.fields[k].label or k).lower() for k in changed)
                self._saving(request, f"the tenant's {labels}", services.tenant_update, actor=request.user,
                             tenant=obj, expected=form.shown(changed), **changed)
            new_url = form.cleaned_data.get("new_slack_webhook_url")
            if form.cleaned_data.get("clear_slack_webhook_url"):
                self._saving(request, "the Slack webhook's removal", services.tenant_slack_webhook_set,
                             actor=request.user, tenant=obj, url="")
            elif new_url:
                self._saving(request, "the new Slack webhook URL", services.tenant_slack_webhook_set,
                             actor=request.user, tenant=obj, url=new_url)
        else:
            created = self._saving(request, f"the new tenant {data.get('slug')}", services.tenant_create,
                                   actor=request.user, **data)
            obj.pk = created.pk
            obj._state.adding = False

    def save_formset(self, request, form, formset, change):
        tenant = form.instance
        actor = request.user
        for sub in formset.forms:  # before any write (changeform_view checked already; this is the last word)
            if getattr(sub, "cleaned_data", None) and not formset._should_delete_form(sub):
                _refuse_changed_key(sub)
        def lead_first(sub) -> int:  # new or promoted leads before demotions, so a lead always remains
            data = getattr(sub, "cleaned_data", None) or {}
            return 0 if data.get("role") == Role.LEAD and not formset._should_delete_form(sub) else 1

        for sub in sorted(formset.forms, key=lead_first):
            if not hasattr(sub, "cleaned_data") or not sub.cleaned_data:
                continue
            instance = sub.instance
            saving = functools.partial(self._saving, request)
            if formset._should_delete_form(sub):
                if instance.pk:
                    if isinstance(instance, Quota):
                        saving(f"the removal of the quota in pool {instance.pool}", services.quota_delete,
                               actor=actor, quota=instance)
                    else:
                        saving(f"the removal of {instance.user}'s membership", services.membership_delete,
                               actor=actor, membership=instance)
                continue
            if isinstance(instance, Quota):
                values = _quota_values(sub)
                if instance.pk and sub.numbers_changed():  # only what this admin changed, if still current
                    saving(f"the quota in pool {instance.pool}", services.quota_update, actor=actor, quota=instance,
                           expected_version=sub.cleaned_data["version"],
                           **{f: values[f] for f in sub.numbers_changed()})
                elif not instance.pk:
                    saving(f"the new quota in pool {sub.cleaned_data['pool']}", services.quota_create, actor=actor,
                           tenant=tenant, pool=sub.cleaned_data["pool"], **values)
            elif isinstance(instance, Membership):
                if instance.pk and sub.has_changed():
                    saving(f"{instance.user}'s role", services.membership_update, actor=actor, membership=instance,
                           role=sub.cleaned_data["role"], expected_role=sub.shown(["role"]).get("role"))
                elif not instance.pk:
                    saving(f"{sub.cleaned_data['user']}'s membership", services.membership_create, actor=actor,
                           tenant=tenant, user=sub.cleaned_data["user"], role=sub.cleaned_data["role"])
        formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []


# --- quotas --------------------------------------------------------------------------------


MAX_QUOTA_NUMBER = 2**31 - 1  # PostgreSQL integer, the quota columns' type


class QuotaBulkForm(forms.Form):
    """Set the same numbers on every selected quota; empty fields stay as they are."""

    # The upper bound is the column's (the services refuse more): a field error here, not a refusal after.
    max_nodes = forms.IntegerField(required=False, min_value=0, max_value=MAX_QUOTA_NUMBER)
    burst_nodes = forms.IntegerField(required=False, min_value=0, max_value=MAX_QUOTA_NUMBER)
    max_duration_hours = forms.IntegerField(required=False, min_value=1, max_value=services.MAX_DURATION_HOURS,
                                            help_text="Leave empty to keep; tick below to remove the limit.")
    no_duration_limit = forms.BooleanField(required=False, label="Remove the duration limit")

    def changes(self) -> dict[str, Any]:
        values = {k: self.cleaned_data[k] for k in ("max_nodes", "burst_nodes", "max_duration_hours")
                  if self.cleaned_data.get(k) is not None}
        if self.cleaned_data.get("no_duration_limit"):
            values["max_duration_hours"] = None
        return values


@admin.register(Quota)
class QuotaAdmin(ServiceAdminMixin, SimpleHistoryAdmin):
    form = QuotaAdminForm
    list_display = ("tenant", "pool", "max_nodes", "burst_nodes", "max_duration_hours", "updated_at")
    list_editable = ("max_nodes", "burst_nodes", "max_duration_hours")
    list_filter = ("pool", "tenant")
    search_fields = ("tenant__slug", "pool__name")
    list_select_related = ("tenant", "pool")
    actions = ["bulk_change"]

    def get_readonly_fields(self, request, obj=None):
        return ("tenant", "pool", "updated_at") if obj is not None else ("updated_at",)

    def get_changelist_form(self, request, **kwargs):
        return super().get_changelist_form(request, **{"form": QuotaListForm, **kwargs})

    def get_fields(self, request, obj=None):
        fields = [f for f in super().get_fields(request, obj) if f != "version"]
        return [*fields, "version"] if obj is not None else fields  # a new quota has no version to check

    def revert_disabled(self, request, obj=None):
        return True  # a revert would save a historical row past the service (and its audit)

    @staticmethod
    def _require_ids(*ids: str) -> None:
        """django-simple-history looks ids up as given: "abc" was a database error (a 500), now a 404."""
        try:
            for value in ids:
                Quota._meta.pk.to_python(unquote(value))
        except ValidationError:
            raise Http404("No such quota or version.") from None

    def history_view(self, request, object_id, extra_context=None):
        self._require_ids(object_id)
        return super().history_view(request, object_id, extra_context)

    def set_history_delta_changes(self, request, historical_records, foreign_keys_are_objs=True):
        # Each row is named by the quota as it was (Quota.__str__ names its tenant and pool): give that quota the
        # tenant and pool the history query joined already, not two queries of its own per row.
        for record in historical_records:
            quota = record.history_object
            try:
                quota.tenant, quota.pool = record.tenant, record.pool
            except ObjectDoesNotExist:
                continue  # named as before (simple-history keeps rows whose tenant or pool is gone)
            record.history_object = quota
        super().set_history_delta_changes(request, historical_records, foreign_keys_are_objs)

    def history_form_view(self, request, object_id, version_id, extra_context=None):
        if request.method == "POST":
            raise PermissionDenied("Quotas are changed through the quota form, never by reverting.")
        self._require_ids(object_id, version_id)
        return super().history_form_view(request, object_id, version_id, extra_context)

    # single quota page

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        if request.method == "POST" and object_id:
            obj = self.get_object(request, object_id)
            if obj is not None:
                Form = self.get_form(request, obj, change=True)
                form = Form(request.POST, request.FILES, instance=self.get_object(request, object_id))
                if form.is_valid():
                    review = lowering_review(request, self, [(obj, _quota_values(form))])
                    if review is not None:
                        return review
        return super().changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        values = _quota_values(form)
        if change:
            services.quota_update(actor=request.user, quota=obj, expected_version=form.cleaned_data["version"],
                                  **values)
        else:
            created = services.quota_create(actor=request.user, tenant=form.cleaned_data["tenant"],
                                            pool=form.cleaned_data["pool"], **values)
            obj.pk = created.pk
            obj._state.adding = False

    def delete_model(self, request, obj):
        services.quota_delete(actor=request.user, quota=obj)

    # in-place edits on the list

    def changelist_view(self, request, extra_context=None):
        if request.method == "POST" and "_save" in request.POST and self.list_editable:
            try:
                response = self._save_list_edits(request)
            except DomainError as exc:
                self.message_user(request, exc.detail, messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
            if response is not None:
                return response
        return super().changelist_view(request, extra_context)

    def _save_list_edits(self, request):
        """Validate the list's formset like Django does, then save all rows in one audited service call.

        Returns None to let Django's own view render validation errors (it saves nothing then).
        """
        if not self.has_change_permission(request):
            raise PermissionDenied
        FormSet = self.get_changelist_formset(request)
        queryset = self._get_list_editable_queryset(request, FormSet.get_default_prefix())
        formset = FormSet(request.POST, request.FILES, queryset=queryset)
        if not formset.is_valid():
            return None
        edited = [form for form in formset.forms if form.has_changed()]
        originals = {q.pk: q for q in Quota.objects.select_related("tenant", "pool").filter(
            pk__in=[form.instance.pk for form in edited])}
        changes = [(originals[form.instance.pk], {f: form.cleaned_data[f] for f in form.changed_data
                                                  if f in QUOTA_FIELDS}) for form in edited]
        # What the page showed for each edited row: a row changed since (by another admin, the API) is refused
        # here, before the lowering review, and again by the service under the rows' locks.
        expected = {form.instance.pk: form.shown() for form in edited}
        for quota, _ in changes:
            if any(getattr(quota, f) != v for f, v in expected[quota.pk].items()):
                raise InvalidState(f"The quota {quota.tenant}/{quota.pool} was changed since you opened the list; "
                                   "nothing was saved: reload the list and make your changes again.")
        review = lowering_review(request, self, changes)
        if review is not None:
            return review
        updated = services.quota_bulk_update(actor=request.user, changes=[(q.pk, v) for q, v in changes],
                                             reason="admin list edit", expected=expected)
        for form in edited:
            self.log_change(request, originals[form.instance.pk], self.construct_change_message(request, form, None))
        if updated:
            self.message_user(request,
                              f"{count_of(len(updated), 'quota')} changed; each change is in the audit log.",
                              messages.SUCCESS)
        return HttpResponseRedirect(request.get_full_path())

    @admin.action(description="Change numbers of selected quotas…")
    def bulk_change(self, request, queryset):
        quotas = list(queryset.select_related("tenant", "pool"))
        if "apply" in request.POST:
            form = QuotaBulkForm(request.POST)
            if form.is_valid():
                values = form.changes()
                review = lowering_review(request, self, [(q, values) for q in quotas])
                if review is not None:
                    return review
                updated = self.run_service(request, services.quota_bulk_update, actor=request.user,
                                           changes=[(q.pk, values) for q in quotas], reason="admin bulk action")
                if updated is not None:
                    self.message_user(request, f"{count_of(len(updated), 'quota')} changed.", messages.SUCCESS)
                return None
        else:
            form = QuotaBulkForm()
        context = {
            **self.admin_site.each_context(request),
            "title": "Change the numbers of this quota" if len(quotas) == 1 else "Change the numbers of these quotas",
            "opts": self.model._meta,
            "quotas": quotas,
            "form": form,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/tenants/quota/bulk_change.html", context)


# --- API tokens -----------------------------------------------------------------------------------


@admin.register(ApiToken)
class ApiTokenAdmin(ServiceAdminMixin, admin.ModelAdmin):
    """Who holds which token, when each was last used, and revoking them. Tokens are issued with
    ``manage.py issue_token`` (the key is printed once and only its hash stored), so there is no add here."""

    list_display = ("prefix", "user", "name", "created_at", "last_used_at", "expires_at", "revoked")
    list_filter = ("revoked",)
    search_fields = ("prefix", "name", "user__username")
    readonly_fields = ("user", "name", "prefix", "created_at", "last_used_at", "expires_at", "revoked")
    fields = readonly_fields
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # revoked, not deleted: the record of who held it stays

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request, queryset) -> None:
        done = sum(1 for token in queryset.filter(revoked=False)
                   if self.run_service(request, services.token_revoke, actor=request.user, token=token) is not None)
        presenting = "it" if done == 1 else "them"
        self.message_user(request, f"Revoked {count_of(done, 'token')}; requests presenting {presenting} are refused"
                          " from now on.",
                          messages.SUCCESS if done else messages.WARNING)


# --- user accounts ---------------------------------------------------------------------------

User = get_user_model()
if admin.site.is_registered(User):
    admin.site.unregister(User)


class UserChangeForm(ShownValuesMixin, DjangoUserAdmin.form):
    """Django's user change form; the account's fields and privileges post what the page showed, so a page
    opened before another admin's change (an account disabled, a privilege taken away) does not put it back."""

    watched = ("username", "first_name", "last_name", "email", "is_active", "is_staff", "is_superuser", "groups",
               "user_permissions")


@admin.register(User)
class UserAdmin(ServiceTransactionMixin, DjangoUserAdmin):
    """Django's user admin, its forms and its permissions (superusers, or staff given the auth
    permissions), with every write through tenants.services: accounts created (user_create),
    fields and privileges changed (user_update: is_active, is_staff, is_superuser, groups,
    permissions), passwords set (user_set_password) and accounts deleted (user_delete) are audited."""

    form = UserChangeForm

    @method_decorator(sensitive_post_parameters())
    @csrf_protect_m
    def add_view(self, request, form_url="", extra_context=None):
        # Django's UserAdmin wraps this in a transaction; user_create runs its own (durable) one.
        return self._add_view(request, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        if not change:
            created = services.user_create(
                actor=request.user, username=data["username"], email=data.get("email", ""),
                password=data["password1"] if data["set_usable_password"] else None)
            obj.pk, obj.password = created.pk, created.password
            obj._state.adding = False
            return
        changes = {f: data[f] for f in form.changed_data if f in services.USER_FIELDS}
        changes.update({f: list(data[f]) for f in form.changed_data if f in services.USER_M2M})
        if changes:
            services.user_update(actor=request.user, user=obj, expected=form.shown(changes), **changes)

    def save_related(self, request, form, formsets, change):
        # groups and user_permissions were set by user_update (save_model), in its transaction.
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)

    def delete_model(self, request, obj):
        services.user_delete(actor=request.user, user=obj)

    def get_deleted_objects(self, objs, request):
        # user_delete removes the account's memberships (keeping each tenant a lead) and its API tokens:
        # their own pages offering no "delete" must not stop the account's deletion here.
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        owned = {str(m._meta.verbose_name) for m in (ApiToken, Membership)}
        return deleted, counts, {p for p in perms_needed if str(p) not in owned}, protected

    @method_decorator(sensitive_post_parameters())
    def user_change_password(self, request, id, form_url=""):
        """Django's page; a valid submission is saved by user_set_password (audited), anything else
        (the form, its errors, a refusal) is Django's own answer."""
        if request.method == "POST":
            user = self.get_object(request, unquote(id))
            if user is not None and self.has_change_permission(request, user):
                form = self.change_password_form(user, request.POST)
                if form.is_valid() and (form.cleaned_data["set_usable_password"] or "unset-password" in request.POST):
                    password = form.cleaned_data["password1"] if form.cleaned_data["set_usable_password"] else None
                    try:
                        services.user_set_password(actor=request.user, user=user, password=password)
                    except DomainError as exc:
                        self.message_user(request, exc.detail, messages.ERROR)
                        return HttpResponseRedirect(request.get_full_path())
                    self.log_change(request, user, self.construct_change_message(request, form, None))
                    self.message_user(request, "Password changed successfully." if password is not None
                                      else "Password-based authentication was disabled.", messages.SUCCESS)
                    update_session_auth_hash(request, user)
                    return HttpResponseRedirect(
                        reverse(f"{self.admin_site.name}:{user._meta.app_label}_{user._meta.model_name}_change",
                                args=(user.pk,)))
        return super().user_change_password(request, id, form_url)


if admin.site.is_registered(Group):
    admin.site.unregister(Group)


@admin.register(Group)
class GroupAdmin(ServiceTransactionMixin, DjangoGroupAdmin):
    """Django's group admin (its forms and permissions), saved by group_save / group_delete: a group's
    permissions are privileges of every member, so each change is audited like a user's own."""

    def save_model(self, request, obj, form, change):
        services.group_save(actor=request.user, group=obj, name=form.cleaned_data["name"],
                            permissions=list(form.cleaned_data.get("permissions") or []))

    def save_related(self, request, form, formsets, change):
        # the permissions were set by group_save (save_model), in its transaction.
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)

    def delete_model(self, request, obj):
        services.group_delete(actor=request.user, group=obj)

