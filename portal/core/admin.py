"""Admin building blocks every app's admin uses, and the audit log's own admin page.

Writes from the admin go through the same services as the API and the pages, so they are
validated, locked and audited the same way. Those services run in their own durable
transactions, which Django's admin would otherwise wrap in its own ``atomic`` (and a durable
block refuses to nest): ``ServiceAdminMixin`` runs the add/change/delete views without that
wrapper and turns a service's domain error into a message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.actions import delete_selected as django_delete_selected
from django.contrib.admin.options import IncorrectLookupParameters, csrf_protect_m
from django.contrib.admin.utils import model_ngettext
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import DataError, connections, transaction
from django.db.models import Max, Min
from django.http import HttpResponseRedirect
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from . import events
from .exceptions import DomainError
from .models import AuditLog, OutboxEvent
from .words import count_of

__all__ = [
    "ListLookupsMixin", "StaffAdminMixin", "ServiceAdminMixin", "ServiceTransactionMixin", "ReadOnlyAdminMixin",
    "ShownValuesMixin",
    "admin_hooks", "AuditLogAdmin", "OutboxEventAdmin", "format_change",
]

# Late-bound helpers one app's admin offers another without an upward import: e.g. the
# reservations admin registers "quota_conflicts" (which bookings a lowered quota no longer
# covers) for the tenants admin, which may not import reservations.
admin_hooks: dict[str, Callable[..., Any]] = {}


def _is_platform_admin(request) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff)


class ListLookupsMixin:
    """A list filter given in the URL that the database cannot run is Django's "invalid filter" page.

    Django checks a lookup's value when it builds the list's query, but some fail only when the
    list is counted (a year out of range, a range literal PostgreSQL cannot parse): a 500 before.
    """

    def get_changelist_instance(self, request):
        try:
            with transaction.atomic():  # a savepoint, so a refused query leaves the request usable
                return super().get_changelist_instance(request)
        except (ValueError, OverflowError, DataError) as exc:
            raise IncorrectLookupParameters(exc) from exc

    def response_action(self, request, queryset):
        # Django filters the list by the posted ids as given: one that is no key ("abc") was a ValueError.
        try:
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                self.model._meta.pk.to_python(value)
        except ValidationError:
            self.message_user(request, "No such rows: the selection names rows that do not exist.",
                              messages.WARNING)
            return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset)


class StaffAdminMixin(ListLookupsMixin):
    """Platform admins are the staff users (DESIGN §3): being staff is the permission here."""

    def has_module_permission(self, request):
        return _is_platform_admin(request)

    def has_view_permission(self, request, obj=None):
        return _is_platform_admin(request)

    def has_add_permission(self, request, *args):
        return _is_platform_admin(request)

    def has_change_permission(self, request, obj=None):
        return _is_platform_admin(request)

    def has_delete_permission(self, request, obj=None):
        return _is_platform_admin(request)


def delete_selected_through_services(modeladmin, request, queryset):
    """Django's "delete selected", reporting and logging only the rows the services really deleted.

    Django counts the selection and writes its "deleted" history entries before deleting; here
    delete_queryset runs each row's service (a refusal is a message, see run_service), so a refused
    row would have been reported "Successfully deleted" (and logged so) while it stayed.
    """
    if not request.POST.get("post"):
        return django_delete_selected(modeladmin, request, queryset)  # the confirmation page
    _, _, perms_needed, protected = modeladmin.get_deleted_objects(queryset, request)
    if protected:
        return django_delete_selected(modeladmin, request, queryset)  # the "cannot delete" page
    if perms_needed:
        raise PermissionDenied
    selected = list(queryset.all())
    if not selected:
        return None
    modeladmin.delete_queryset(request, queryset)
    remaining = set(modeladmin.model._default_manager.filter(pk__in=[o.pk for o in selected])
                    .values_list("pk", flat=True))
    deleted = [o for o in selected if o.pk not in remaining]
    if deleted:
        modeladmin.log_deletions(request, deleted)
        modeladmin.message_user(request, f"Successfully deleted {len(deleted)} "
                                f"{model_ngettext(modeladmin.opts, len(deleted))}.", messages.SUCCESS)
    return None


class ServiceTransactionMixin(ListLookupsMixin):
    """Run add/change/delete outside the admin's transaction: the services own theirs.

    Permissions stay the ModelAdmin's own (Django's model permissions); ServiceAdminMixin adds
    the platform admins' (is_staff) on top.
    """

    def get_actions(self, request):
        actions = super().get_actions(request)
        if "delete_selected" in actions:
            _, name, description = actions["delete_selected"]
            actions["delete_selected"] = (delete_selected_through_services, name, description)
        return actions

    @csrf_protect_m
    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        try:
            return self._changeform_view(request, object_id, form_url, extra_context)
        except DomainError as exc:
            self.message_user(request, exc.detail, messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    @csrf_protect_m
    def delete_view(self, request, object_id, extra_context=None):
        try:
            return self._delete_view(request, object_id, extra_context)
        except DomainError as exc:
            self.message_user(request, exc.detail, messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def delete_queryset(self, request, queryset):
        # Each row through delete_model (the admin's service); a refusal is a message, the others still go.
        for obj in queryset:
            self.run_service(request, self.delete_model, request, obj)

    def run_service(self, request, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call a service for an admin action; report a domain error as a message, return None."""
        try:
            return fn(*args, **kwargs)
        except DomainError as exc:
            self.message_user(request, exc.detail, messages.ERROR)
            return None


class ServiceAdminMixin(ServiceTransactionMixin, StaffAdminMixin):
    """Run add/change/delete outside the admin's transaction (the services own theirs); staff may."""


class ShownValuesMixin:
    """A change form whose watched fields also post, hidden, the values the page showed (Django's
    show_hidden_initial), so only what the admin changed counts as changed: a page opened before someone
    else's change does not post the old values back over it. A field this admin changed that was also changed
    since the page was opened is refused (a form error, nothing saved); ``shown`` gives the values to check
    again under the row's lock in the service. A POST without the hidden values (a hand-made one) is taken
    as before: changed where it differs from the row."""

    watched: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in self.watched:
            # Rendered with the hidden value; posted, compared with it only when it came back (a missing one
            # would read as empty, and an unticked box as unchanged).
            if name in self.fields and (not self.is_bound or self.add_initial_prefix(name) in self.data):
                self.fields[name].show_hidden_initial = True

    def _shown_raw(self, name: str):
        key = self.add_initial_prefix(name)
        if key not in self.data:
            return None, False
        return self.fields[name].hidden_widget().value_from_datadict(self.data, self.files, key), True

    def shown(self, names) -> dict[str, Any]:
        """The values the page showed for names (those it posted), as Python values."""
        values = {}
        for name in names:
            raw, posted = self._shown_raw(name) if name in self.fields else (None, False)
            if posted:
                try:
                    values[name] = self.fields[name].clean(raw)
                except ValidationError:
                    continue
        return values

    def clean(self):
        cleaned = super().clean()
        if self.instance.pk is None:
            return cleaned
        changed_since = []
        for name in self.watched:
            if name not in self.changed_data:
                continue
            raw, posted = self._shown_raw(name)
            field = self.fields[name]
            if posted and field.has_changed(self.get_initial_for_field(field, name), raw):
                changed_since.append(str(field.label or name))
        if changed_since:
            raise forms.ValidationError(
                f"{', '.join(changed_since)}: changed since you opened this page (by another admin or the API); "
                "nothing was saved. Reload the page and make your change again.", code="stale")
        return cleaned


class ReadOnlyAdminMixin(StaffAdminMixin):
    """A log: staff read it; nobody adds, changes or deletes rows here."""

    def has_add_permission(self, request, *args):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# An instant as the audit stores it: ISO 8601 with its offset ("2026-12-20T12:00:00Z").
_INSTANT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:\d{2})")


def _local_instant(text: str) -> str | None:
    """text as a time in the current zone (the reader's, on a portal page), or None if not an instant."""
    if not _INSTANT.fullmatch(text):
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    local = timezone.localtime(moment)
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()}"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if isinstance(value, str):
        text = _local_instant(value) or text
    return text if len(text) <= 80 else text[:79] + "…"


def format_change(before: dict[str, Any], after: dict[str, Any], *,
                  label: Callable[[str], str] | None = None, value: Callable[[str, Any], Any] | None = None) -> str:
    """Return "field: old → new" for every field that differs (or was set / removed).

    The admin shows the stored field names and values; a portal page passes label (a field's name in
    words) and value (a coded value in words)."""
    name = label or str

    def show(key: str, raw: Any) -> str:
        return _short(value(key, raw) if value else raw)

    parts = []
    for key in list(dict.fromkeys([*before.keys(), *after.keys()])):
        old, new = before.get(key), after.get(key)
        if key in before and key in after and old == new:
            continue
        if key not in before:
            parts.append(f"{name(key)}: {show(key, new)}")
        elif key not in after:
            parts.append(f"{name(key)}: {show(key, old)} → (removed)")
        else:
            parts.append(f"{name(key)}: {show(key, old)} → {show(key, new)}")
    return "; ".join(parts)



# --- the date hierarchy, read off the date column's index ---------------------------------------------------


class _IndexedDatetimesMixin:
    """``datetimes()`` for the admin's date hierarchy without a DISTINCT over every row.

    Django lists the years (months, days) that have rows with ``SELECT DISTINCT DATE_TRUNC(...)`` of the
    whole filtered table: on an audit log, delivery log or check history that only grows, every visit to
    the list read all of it. Here the candidate periods between the first and the last row (an index's
    two ends) are each probed with one ``EXISTS`` range lookup, all in one statement.
    """

    def datetimes(self, field_name, kind, order="ASC", tzinfo=None, is_dst=None):
        if kind not in ("year", "month", "day"):
            return super().datetimes(field_name, kind, order, tzinfo, is_dst)
        tz = tzinfo or timezone.get_current_timezone()
        ends = self.aggregate(first=Min(field_name), last=Max(field_name))
        if ends["first"] is None:
            return []
        first, last = ends["first"].astimezone(tz), ends["last"].astimezone(tz)
        candidates, at = [], _truncate(first, kind, tz)
        while at <= last:
            nxt = _next_period(at, kind, tz)
            candidates.append((at, nxt))
            at = nxt
        parts, params = [], []
        for lo, hi in candidates:
            probe = self.filter(**{f"{field_name}__gte": lo, f"{field_name}__lt": hi}).order_by().values("pk")[:1]
            sql, p = probe.query.sql_with_params()
            parts.append(f"EXISTS ({sql})")
            params.extend(p)
        with connections[self.db].cursor() as cur:
            cur.execute("SELECT " + ", ".join(parts), params)
            found = cur.fetchone()
        hits = [lo for (lo, _), yes in zip(candidates, found, strict=True) if yes]
        return hits if order == "ASC" else hits[::-1]


def _truncate(at: datetime, kind: str, tz) -> datetime:
    return datetime(at.year, 1 if kind == "year" else at.month, at.day if kind == "day" else 1, tzinfo=tz)


def _next_period(at: datetime, kind: str, tz) -> datetime:
    if kind == "year":
        return datetime(at.year + 1, 1, 1, tzinfo=tz)
    if kind == "month":
        return datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=tz)
    day = at.date() + timedelta(days=1)
    return datetime(day.year, day.month, day.day, tzinfo=tz)



class IndexedValuesListFilter(admin.AllValuesFieldListFilter):
    """Django's "all values" list filter, its choices read by walking the column's index.

    Django lists the choices with ``SELECT DISTINCT column`` of the whole table: on a log that only
    grows, every visit read all of it. Here a recursive statement jumps from one value to the next
    (``min(column) WHERE column > previous``), one index probe per distinct value. For a column that
    leads a B-tree index. The choices are the table's, as Django's are when the list is not narrowed.
    """

    def __init__(self, field, request, params, model, model_admin, field_path):
        super().__init__(field, request, params, model, model_admin, field_path)
        table = connections[model._default_manager.db].ops.quote_name(model._meta.db_table)
        column = connections[model._default_manager.db].ops.quote_name(field.column)
        self.lookup_choices = _IndexWalk(model._default_manager.db, table, column)


class _IndexWalk:
    """The distinct non-null values of one column, ascending, read lazily (when the filter renders)."""

    def __init__(self, db: str, table: str, column: str) -> None:
        self.db, self.table, self.column = db, table, column
        self._values: list | None = None

    def __iter__(self):
        if self._values is None:
            # Constant, quoted identifiers only: no user input reaches this text.
            sql = (f"WITH RECURSIVE walk(v) AS ("  # noqa: S608
                   f"SELECT min({self.column}) FROM {self.table} "
                   f"UNION ALL SELECT (SELECT min({self.column}) FROM {self.table} WHERE {self.column} > walk.v) "
                   f"FROM walk WHERE walk.v IS NOT NULL) SELECT v FROM walk WHERE v IS NOT NULL")
            with connections[self.db].cursor() as cur:
                cur.execute(sql)
                self._values = [row[0] for row in cur.fetchall()]
        return iter(self._values)


_INDEXED_DATES: dict[type, type] = {}


class IndexedDateHierarchyMixin:
    """A ModelAdmin mixin: its ``date_hierarchy`` probes the date column's index (see _IndexedDatetimesMixin)."""

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        cls = qs.__class__
        if not issubclass(cls, _IndexedDatetimesMixin):
            if cls not in _INDEXED_DATES:
                _INDEXED_DATES[cls] = type(f"IndexedDates{cls.__name__}", (_IndexedDatetimesMixin, cls), {})
            qs.__class__ = _INDEXED_DATES[cls]
        return qs


@admin.register(AuditLog)
class AuditLogAdmin(IndexedDateHierarchyMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ("created_at", "actor", "action", "object_type", "object_id", "tenant_id", "change")
    list_filter = (("action", IndexedValuesListFilter), ("object_type", IndexedValuesListFilter))
    search_fields = ("action", "object_type", "object_id", "actor__username")
    list_select_related = ("actor",)
    date_hierarchy = "created_at"
    readonly_fields = ("created_at", "actor", "action", "object_type", "object_id", "tenant_id", "change_table")
    fields = readonly_fields
    show_full_result_count = False

    @admin.display(description="before → after")
    def change(self, obj: AuditLog) -> str:
        return format_change(obj.before or {}, obj.after or {})

    @admin.display(description="before → after")
    def change_table(self, obj: AuditLog) -> str:
        keys = list(dict.fromkeys([*(obj.before or {}).keys(), *(obj.after or {}).keys()]))
        if not keys:
            return "—"
        rows = format_html_join(
            "", "<tr><th>{}</th><td>{}</td><td>{}</td></tr>",
            ((k, _short((obj.before or {}).get(k, "")), _short((obj.after or {}).get(k, ""))) for k in keys),
        )
        return format_html("<table><tr><th></th><th>before</th><th>after</th></tr>{}</table>", rows)


@admin.register(OutboxEvent)
class OutboxEventAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Domain events still waiting for their background subscribers (normally empty within seconds)."""

    list_display = ("id", "event", "created_at", "available_at", "attempts", "stuck")
    list_filter = ("event",)
    readonly_fields = ("event", "payload", "created_at", "available_at", "attempts")
    fields = readonly_fields
    actions = ["requeue"]

    @admin.display(boolean=True, description="stuck")
    def stuck(self, obj: OutboxEvent) -> bool:
        return obj.attempts >= events.OUTBOX_MAX_ATTEMPTS

    @admin.action(description="Publish again now (fresh attempts)")
    def requeue(self, request, queryset) -> None:
        count = events.outbox_requeue(list(queryset.values_list("id", flat=True)), actor=request.user)
        self.message_user(request, f"{count_of(count, 'event')} {'is' if count == 1 else 'are'} due again; the relay "
                                   f"publishes {'it' if count == 1 else 'them'} within 15 s.")
