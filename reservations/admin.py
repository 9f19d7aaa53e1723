"""Admin for the fleet and the bookings: pools, nodes (drain, maintenance, return) and reservations.

Every change is a service call, so it is validated, locked and audited exactly as from the
API. Reservations are read-only here except for cancelling, which goes through
``reservation_cancel``. This module also offers the tenants admin the "which bookings would a
lowered quota no longer cover" check (tenants may not import reservations).
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from portal.core.actors import STAFF_WORDS
from portal.core.admin import ReadOnlyAdminMixin, ServiceAdminMixin, ShownValuesMixin, admin_hooks
from portal.core.exceptions import InvalidState
from portal.core.words import count_of

from . import selectors, services
from .choices import HOLDING_STATUSES, AllocationKind, NodeState
from .models import Allocation, Node, Pool, Reservation

MAX_LISTED_CONFLICTS = 200


# --- the quota-lowering check (used by tenants.admin) ---------------------------------------


def quota_conflicts(*, quota: Any, max_nodes: int, burst_nodes: int, max_duration_hours: int | None,
                    burst_enabled: bool | None = None) -> list[dict[str, Any]]:
    """Return the open bookings of quota's tenant and pool that the new numbers would not cover.

    A booking is affected when the tenant's peak in its (remaining) window exceeds the new
    guaranteed nodes — it becomes burst, or exceeds even max + burst — or when it is longer
    than the new maximum duration. Bookings are never changed by this; the admin is told.
    burst_enabled: the tenant's new burst flag (None: as it is), for a change that turns burst off.
    """
    now = timezone.now()
    if burst_enabled is None:
        burst_enabled = quota.tenant.burst_enabled
    limit = max_nodes + (burst_nodes if burst_enabled else 0)
    rows: list[dict[str, Any]] = []
    reservations = (
        Reservation.objects.filter(tenant_id=quota.tenant_id, pool_id=quota.pool_id, status__in=HOLDING_STATUSES,
                                   period__endswith__gt=now)
        .select_related("created_by")
        .order_by("period")[:MAX_LISTED_CONFLICTS]
    )
    for reservation in reservations:
        start, end = max(reservation.period.lower, now), reservation.period.upper
        peak = selectors.tenant_peak_usage(tenant_id=quota.tenant_id, pool_id=quota.pool_id, start=start, end=end)
        reasons = []
        if peak > limit:
            reasons.append(f"the tenant holds up to {count_of(peak, 'node')} then; the new limit is {limit}")
        elif peak > max_nodes:
            reasons.append(f"up to {count_of(peak, 'node')} then: beyond the {max_nodes} guaranteed (burst)")
        hours = (reservation.period.upper - reservation.period.lower).total_seconds() / 3600
        if max_duration_hours is not None and hours > max_duration_hours:
            reasons.append(f"{hours:g} h long; the new maximum is {max_duration_hours} h")
        if reasons:
            rows.append({"reservation": reservation, "peak": peak, "over_limit": peak > limit,
                         "reasons": reasons, "url": reverse("admin:reservations_reservation_change",
                                                            args=[reservation.pk])})
    return rows


admin_hooks["quota_conflicts"] = quota_conflicts


# --- pools ---------------------------------------------------------------------------------


class PoolForm(ShownValuesMixin, forms.ModelForm):
    # A page opened before another admin's change does not post its old values back (ShownValuesMixin).
    watched = services.POOL_FIELDS

    class Meta:
        model = Pool
        fields = ("name", *services.POOL_FIELDS)

    def clean_slot_minutes(self):
        value = self.cleaned_data["slot_minutes"]
        why = services.slot_minutes_error(value)
        if why:
            raise forms.ValidationError(why)
        return value


@admin.register(Pool)
class PoolAdmin(ServiceAdminMixin, admin.ModelAdmin):
    form = PoolForm
    list_display = ("name", "gpu_model", "gpus_per_node", "slot_minutes", "on_demand_rate", "node_total")
    search_fields = ("name", "gpu_model")
    fields = ("name", "gpu_model", "gpus_per_node", "slot_minutes", "on_demand_rate", "created_at")

    def get_readonly_fields(self, request, obj=None):
        return ("name", "created_at") if obj is not None else ("created_at",)

    def has_delete_permission(self, request, obj=None):
        return False  # nodes and bookings point at pools; retire nodes instead

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(node_count=Count("nodes"))

    @admin.display(description="nodes", ordering="node_count")
    def node_total(self, obj: Pool) -> int:
        return obj.node_count  # counted in the list's own query, not one COUNT per row

    def save_model(self, request, obj, form, change):
        data = {f: form.cleaned_data[f] for f in services.POOL_FIELDS if f in form.cleaned_data}
        if change:
            changed = {k: data[k] for k in form.changed_data if k in data}
            services.pool_update(actor=request.user, pool=obj, expected=form.shown(changed), **changed)
        else:
            created = services.pool_create(actor=request.user, name=form.cleaned_data["name"], **data)
            obj.pk = created.pk
            obj._state.adding = False


# --- nodes ---------------------------------------------------------------------------------


class MaintenanceWindowForm(forms.Form):
    start = forms.DateTimeField(help_text="UTC, on the pool's slot grid (e.g. 2026-03-01 08:00).")
    end = forms.DateTimeField(help_text="UTC; the node is blocked for new bookings until then.")
    note = forms.CharField(required=False, max_length=255)

    def clean(self):
        data = super().clean()
        if data.get("start") and data.get("end") and data["end"] <= data["start"]:
            raise forms.ValidationError("The end must be after the start.")
        return data


class MaintenanceInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = Allocation
    verbose_name = "maintenance window"
    verbose_name_plural = "maintenance windows"
    fields = ("period", "note", "active", "created_by", "created_at")
    readonly_fields = fields
    extra = 0

    def get_queryset(self, request):
        return super().get_queryset(request).filter(kind=AllocationKind.MAINTENANCE).select_related("created_by")


class NodeForm(ShownValuesMixin, forms.ModelForm):
    # A stale page never returns a node drained (or failed) since to service (ShownValuesMixin).
    watched = ("state", "state_reason")

    class Meta:
        model = Node
        fields = ("hostname", "pool", "state", "state_reason")

    def clean_hostname(self):
        # Asked here, as node_create will: refused there, staff got a message over an emptied form.
        value = self.cleaned_data["hostname"]
        why = services.hostname_error(value)
        if why:
            raise forms.ValidationError(why)
        return value


@admin.register(Node)
class NodeAdmin(ServiceAdminMixin, admin.ModelAdmin):
    form = NodeForm
    list_display = ("hostname", "pool", "state", "state_reason", "updated_at")
    list_filter = ("pool", "state")
    search_fields = ("hostname",)
    list_select_related = ("pool",)
    inlines = [MaintenanceInline]
    actions = ["drain", "schedule_maintenance", "end_maintenance", "return_to_service"]

    def get_readonly_fields(self, request, obj=None):
        return ("hostname", "pool", "gpus") if obj is not None else ()

    def get_fields(self, request, obj=None):
        return ("hostname", "pool", "state", "state_reason", "gpus") if obj is not None else (
            "hostname", "pool", "state")

    def has_delete_permission(self, request, obj=None):
        return False  # a node leaves the fleet by being retired, so its history stays

    def save_model(self, request, obj, form, change):
        if change:
            changed = set(form.changed_data)
            state = form.cleaned_data["state"] if "state" in changed else None
            shown = form.shown(["state"]).get("state") if state is not None else None
            node = services.node_update(  # refused while an open repair owns the node (node_return_blockers)
                actor=request.user, node=obj, state=state,
                reason=form.cleaned_data.get("state_reason", "") if "state_reason" in changed else None,
                only_from=[shown] if shown else None,  # the state the page showed, checked under the node's lock
            )
            if state is not None and node.state != state:
                raise InvalidState(f"{node.hostname} is {node.state} since you opened this page; nothing was "
                                   "saved. Reload the page and make your change again.")
        else:
            created = services.node_create(actor=request.user, hostname=form.cleaned_data["hostname"],
                                           pool=form.cleaned_data["pool"], state=form.cleaned_data["state"])
            obj.pk = created.pk
            obj._state.adding = False

    def _set_state(self, request, queryset, state: str, reason: str, verb: str,
                   only_from: tuple[str, ...] | None = None) -> None:
        done, left = 0, []
        for node in queryset:
            changed = self.run_service(request, services.node_update, actor=request.user, node=node, state=state,
                                       reason=reason, only_from=only_from)
            if changed is None:
                continue  # refused: run_service said why
            if changed.state == state and changed.state_reason == reason:
                done += 1
            else:  # its state was not in only_from (read under its lock): left as it was
                left.append(f"{changed.hostname} ({changed.state})")
        self.message_user(request, f"{verb} {count_of(done, 'node')}.", messages.SUCCESS if done else messages.WARNING)
        if left:
            self.message_user(request, f"Left as they were (already out of service): {', '.join(left)}.",
                              messages.WARNING)

    @admin.action(description="Drain selected nodes (no new bookings)")
    def drain(self, request, queryset):
        # The reason is shown to the tenants holding the node (the nodes API): "platform staff", never the
        # account (portal.core.actors); the node.update audit row records who it was.
        # Available nodes only: a failed, retired or already drained node keeps its state and the reason for it.
        self._set_state(request, queryset, NodeState.DRAINING, f"drained by {STAFF_WORDS}", "Drained",
                        only_from=(NodeState.AVAILABLE,))

    @admin.action(description="Return selected nodes to service")
    def return_to_service(self, request, queryset):
        self._set_state(request, queryset, NodeState.AVAILABLE, "", "Returned to service")

    @admin.action(description="End or withdraw the maintenance windows of selected nodes")
    def end_maintenance(self, request, queryset):
        windows = self.run_service(request, services.maintenance_windows_end, actor=request.user,
                                   nodes=list(queryset))
        if windows is None:
            return
        if not windows:
            self.message_user(request, "No current or coming maintenance window to end.", messages.WARNING)
            return
        described = [f"{w.node.hostname}: "
                     + ("withdrawn" if not w.active else f"ends {w.period.upper:%Y-%m-%d %H:%M} UTC")
                     for w in windows]
        self.message_user(request, "Maintenance " + "; ".join(described) + ".", messages.SUCCESS)

    @admin.action(description="Schedule a maintenance window for selected nodes…")
    def schedule_maintenance(self, request, queryset):
        nodes = list(queryset.select_related("pool"))
        if "apply" in request.POST:
            form = MaintenanceWindowForm(request.POST)
            if form.is_valid():
                start = form.cleaned_data["start"].astimezone(UTC)
                end = form.cleaned_data["end"].astimezone(UTC)
                windows = self.run_service(request, services.maintenance_windows_create, actor=request.user,
                                           nodes=nodes, start=start, end=end, note=form.cleaned_data["note"])
                if windows:
                    self.message_user(request, "Maintenance window scheduled on "
                                      f"{', '.join(n.hostname for n in nodes)}.", messages.SUCCESS)
                return None
        else:
            form = MaintenanceWindowForm()
        context = {
            **self.admin_site.each_context(request),
            "title": "Schedule a maintenance window",
            "opts": self.model._meta,
            "nodes": nodes,
            "form": form,
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/reservations/node/maintenance_window.html", context)


# --- reservations ----------------------------------------------------------------------------


class AllocationInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = Allocation
    fields = ("node", "period", "active", "note")
    readonly_fields = fields
    extra = 0

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("node")


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdminMixin, ServiceAdminMixin, admin.ModelAdmin):
    """Read-mostly: bookings change through the booking rules; here they can only be cancelled."""

    list_display = ("id", "tenant", "pool", "node_count", "start_utc", "end_utc", "status", "billing", "created_by")
    list_filter = ("status", "pool", "billing", "tenant")
    search_fields = ("=id", "name", "tenant__slug")
    list_select_related = ("tenant", "pool", "created_by")
    readonly_fields = ("tenant", "pool", "node_count", "start_utc", "end_utc", "name", "status", "status_reason",
                       "billing", "orchestrator", "cuda_version", "missing_nodes", "created_by", "created_at",
                       "updated_at", "audit")
    fields = readonly_fields
    inlines = [AllocationInline]
    actions = ["cancel"]

    def get_actions(self, request):
        # Read-only for writes, yet staff may cancel: that is a service call, not a row edit.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.display(description="start (UTC)", ordering="period")
    def start_utc(self, obj: Reservation) -> str:
        return obj.period.lower.astimezone(UTC).strftime("%Y-%m-%d %H:%M")

    @admin.display(description="end (UTC)")
    def end_utc(self, obj: Reservation) -> str:
        return obj.period.upper.astimezone(UTC).strftime("%Y-%m-%d %H:%M")

    @admin.display(description="audit log")
    def audit(self, obj: Reservation) -> str:
        url = reverse("admin:core_auditlog_changelist") + f"?object_type=reservations.reservation&object_id={obj.pk}"
        return format_html('<a href="{}">Changes to this reservation</a>', url)

    @admin.action(description="Cancel selected reservations")
    def cancel(self, request, queryset):
        done = []
        for reservation in queryset:
            if self.run_service(request, services.reservation_cancel, actor=request.user,
                                reservation=reservation) is not None:
                done.append(f"#{reservation.pk}")
        if done:
            self.message_user(request, f"Cancelled {', '.join(done)}; their nodes are free again.", messages.SUCCESS)
