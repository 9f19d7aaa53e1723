"""Staff views of health checks and repairs: read-only rows, with repair steps as admin actions.

Every write goes through the services (audited, with the node following its repair); the
admin never edits a check or a repair directly.
"""

from __future__ import annotations

from django.contrib import admin, messages

from portal.core.admin import IndexedDateHierarchyMixin, ReadOnlyAdminMixin
from portal.core.exceptions import DomainError

from . import services
from .choices import RepairState
from .models import HealthCheck, Repair


class _ReadOnly(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Staff (the platform admins, DESIGN §3) read these; nobody edits a row here."""


@admin.register(HealthCheck)
class HealthCheckAdmin(IndexedDateHierarchyMixin, _ReadOnly):
    list_display = ["id", "node", "level", "trigger", "status", "verdict", "recommended_action", "created_at",
                    "finished_at"]
    list_filter = ["verdict", "status", "level", "trigger"]
    search_fields = ["node__hostname", "summary"]
    list_select_related = ["node"]
    date_hierarchy = "created_at"
    show_full_result_count = False  # a fleet's checks are many; skip the COUNT(*) of the whole table


def _step_action(to: str, label: str):
    def action(modeladmin, request, queryset):
        for repair in queryset.select_related("node"):
            try:
                services.repair_advance(actor=request.user, repair=repair, to=to, note="from the admin")
            except DomainError as exc:
                modeladmin.message_user(request, f"Repair #{repair.pk}: {exc.detail}", messages.ERROR)
            else:  # said, as every other admin action says what it did (the list alone read as "nothing")
                modeladmin.message_user(request, f"Repair #{repair.pk} ({repair.node.hostname}): "
                                        f"{RepairState(to).label.lower()}.", messages.SUCCESS)

    action.__name__ = f"repair_to_{to}"
    action.short_description = label
    return action


@admin.register(Repair)
class RepairAdmin(_ReadOnly):
    list_display = ["id", "node", "state", "recommended_action", "opened_at", "closed_at"]
    list_filter = ["state", "recommended_action"]
    search_fields = ["node__hostname", "reason"]
    list_select_related = ["node"]
    actions = [
        _step_action(RepairState.ACCEPTED, "Accept the selected repairs"),
        _step_action(RepairState.CORDONED, "Cordon and drain"),
        _step_action(RepairState.REMEDIATING, "Start remediation"),
        _step_action(RepairState.RETESTING, "Re-test (medium check)"),
        _step_action(RepairState.REJOINED, "Rejoin the fleet (after a passing re-test)"),
        _step_action(RepairState.FAILED, "Mark the nodes failed"),
    ]
