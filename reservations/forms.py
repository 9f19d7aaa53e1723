"""HTML forms: booking, extending, the fleet window. They parse input; services apply the rules."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, timedelta

from django import forms
from django.utils import timezone
from django.utils.html import format_html

from portal.core.fields import DATETIME_MAX, DATETIME_MIN, RANGE_MESSAGE, in_supported_range
from tenants.models import Quota, Tenant

from .choices import CUDA_VERSIONS, DEFAULT_CUDA_VERSION, HOLDING_STATUSES, Orchestrator, ReservationStatus
from .models import Pool

__all__ = [
    "ZonedDateTimeField",
    "parse_zoned",
    "BookingForm",
    "ExtendForm",
    "FleetWindowForm",
    "CalendarWindowForm",
    "SERVICE_FIELD_MAP",
]

# Field names in a service's InvalidInput.fields -> the form field that shows the message.
SERVICE_FIELD_MAP = {
    "cluster.orchestrator": "orchestrator",
    "cluster.cuda_version": "cuda_version",
}


def _shifts(naive: datetime, tz: zoneinfo.ZoneInfo) -> bool:
    """True when naive wall-clock time is skipped or repeated in tz (a daylight-saving change)."""
    early, late = naive.replace(tzinfo=tz, fold=0), naive.replace(tzinfo=tz, fold=1)
    return early.utcoffset() != late.utcoffset()


# A form's datetime-local field cannot hold an offset, so a wall-clock time the clocks repeat (the
# hour after a fall-back change) travels with one hidden beside it: "<local>|<offset>".
FOLD_SEP = "|"


def _repeated_with(naive: datetime, tz: zoneinfo.ZoneInfo, offset: str) -> datetime | None:
    """naive in tz at the UTC offset given (e.g. "-05:00"), if naive is a time the clocks repeat there."""
    try:
        wanted = datetime.fromisoformat(f"2000-01-01T00:00{offset.strip()}").utcoffset()
    except ValueError:
        return None
    for fold in (0, 1):
        candidate = naive.replace(tzinfo=tz, fold=fold)
        real = candidate.astimezone(UTC).astimezone(tz).replace(tzinfo=None) == naive  # not in a skipped gap
        if real and candidate.utcoffset() == wanted:
            return candidate
    return None


def parse_zoned(value: str, tz: zoneinfo.ZoneInfo) -> datetime:
    """Parse ISO 8601: with an offset it is exact; without one it is wall-clock time in tz.

    A wall-clock time that a DST change skips or repeats is refused rather than guessed — unless a
    repeated one comes with the offset that says which of the two it is ("<local>|-05:00", what the
    booking form sends back for a calendar selection in that hour). Raises ValueError with a message
    for the user.
    """
    text, _, fold_offset = (value or "").partition(FOLD_SEP)
    text = text.strip()
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError("Enter a date and time, e.g. 2026-03-02 09:00.")
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        if not DATETIME_MIN.year <= parsed.year < DATETIME_MAX.year:
            raise ValueError(RANGE_MESSAGE)
        chosen = _repeated_with(parsed, tz, fold_offset) if fold_offset and _shifts(parsed, tz) else None
        if chosen is not None:
            parsed = chosen
        elif _shifts(parsed, tz):
            raise ValueError(
                f"{parsed:%Y-%m-%d %H:%M} is skipped or repeated in {tz.key} (a daylight-saving change); "
                "pick another time."
            )
        else:
            parsed = parsed.replace(tzinfo=tz)
    utc = in_supported_range(parsed)
    if utc is None:
        raise ValueError(RANGE_MESSAGE)
    return utc


class ZonedDateTimeInput(forms.DateTimeInput):
    """datetime-local in the user's zone; for a time the clocks repeat, a hidden <name>_offset beside it
    says which of the two it is (FOLD_SEP), so a calendar selection in that hour books what was picked."""

    input_type = "datetime-local"

    @staticmethod
    def _aware(value) -> datetime | None:
        if isinstance(value, datetime):
            return timezone.localtime(value) if timezone.is_aware(value) else None
        if isinstance(value, str) and value:
            try:
                return timezone.localtime(parse_zoned(value, timezone.get_current_timezone()))
            except ValueError:
                return None
        return None

    def format_value(self, value):
        local = self._aware(value)
        if local is not None:
            return local.strftime("%Y-%m-%dT%H:%M")
        if isinstance(value, datetime):
            return value.strftime("%Y-%m-%dT%H:%M")
        if isinstance(value, str):
            return value.partition(FOLD_SEP)[0]
        return value

    def render(self, name, value, attrs=None, renderer=None):
        html = super().render(name, value, attrs, renderer)
        local = self._aware(value)
        if local is None or not _shifts(local.replace(tzinfo=None), local.tzinfo):
            return html
        offset = local.strftime("%z")
        return html + format_html('<input type="hidden" name="{}_offset" value="{}">', name,
                                  f"{offset[:3]}:{offset[3:]}")

    def value_from_datadict(self, data, files, name):
        value = super().value_from_datadict(data, files, name)
        offset = data.get(f"{name}_offset")
        return f"{value}{FOLD_SEP}{offset}" if value and offset and FOLD_SEP not in str(value) else value


class ZonedDateTimeField(forms.Field):
    """A datetime typed in the user's time zone (the active one) or given with an offset; UTC out."""

    widget = ZonedDateTimeInput

    def to_python(self, value):
        if value in self.empty_values:
            return None
        if isinstance(value, datetime):
            return value if timezone.is_aware(value) else parse_zoned(value.isoformat(),
                                                                     timezone.get_current_timezone())
        try:
            return parse_zoned(str(value), timezone.get_current_timezone())
        except ValueError as exc:
            raise forms.ValidationError(str(exc), code="invalid")


class BookingForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(), to_field_name="slug",
                                    widget=forms.HiddenInput)
    pool = forms.ModelChoiceField(queryset=Pool.objects.none(), to_field_name="name", label="Pool",
                                  empty_label=None)
    node_count = forms.IntegerField(label="Nodes", min_value=1, max_value=10_000, initial=1)
    start = ZonedDateTimeField(label="Start")
    end = ZonedDateTimeField(label="End")
    name = forms.CharField(label="Name", max_length=200, required=False,
                           widget=forms.TextInput(attrs={"placeholder": "e.g. pretrain run 7"}))
    orchestrator = forms.ChoiceField(label="Orchestrator", choices=Orchestrator.choices, initial=Orchestrator.SLURM)
    cuda_version = forms.ChoiceField(label="CUDA version", choices=[(v, v) for v in CUDA_VERSIONS],
                                     initial=DEFAULT_CUDA_VERSION)

    def __init__(self, *args, user, tenant, **kwargs):
        super().__init__(*args, **kwargs)
        # Scoped choices: a user can only name their own tenants, and only pools that tenant has a quota in.
        self.fields["tenant"].queryset = Tenant.objects.for_user(user)
        self.fields["tenant"].initial = tenant.slug if tenant else None
        quota_pools = Quota.objects.for_user(user).filter(tenant=tenant).values("pool_id")
        self.fields["pool"].queryset = Pool.objects.filter(pk__in=quota_pools).order_by("name")
        self.fields["node_count"].widget.attrs.update({"inputmode": "numeric"})

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end and end <= start:
            self.add_error("end", "Must be after the start.")
        return data

    def apply_service_errors(self, fields: dict[str, str], detail: str) -> None:
        """Show a service's InvalidInput messages next to the fields they name."""
        placed = False
        for key, message in fields.items():
            name = SERVICE_FIELD_MAP.get(key, key)
            if name in self.fields:
                self.add_error(name, message)
                placed = True
        if not placed:
            self.add_error(None, detail)


class ExtendForm(forms.Form):
    end = ZonedDateTimeField(label="New end")
    # The end the page showed (UTC, hidden): a page opened before someone else changed the end is refused,
    # not allowed to set an end worked out from the old one. Left out (a hand-made POST): not checked.
    shown_end = forms.CharField(required=False, widget=forms.HiddenInput)

    def clean_shown_end(self):
        raw = self.cleaned_data.get("shown_end") or ""
        if not raw:
            return None
        try:
            shown = datetime.fromisoformat(raw)
        except ValueError:
            shown = None
        if shown is None or shown.utcoffset() is None:
            # Said beside the field the page shows (the hidden one has no place for it).
            self.add_error("end", forms.ValidationError(
                "This page is out of date; reload it and make your change again.", code="stale"))
        return shown


class RenameForm(forms.Form):
    # The service checks the rest (control characters); a blank name clears it, as in the API.
    name = forms.CharField(label="Name", max_length=200, required=False, strip=True,
                           widget=forms.TextInput(attrs={"placeholder": "e.g. pretrain run 7"}))
    # The name the page showed (hidden): a page opened before someone else renamed the booking is refused, not
    # allowed to overwrite that name. Left out (a hand-made POST): not checked. Empty is a name shown (none).
    shown_name = forms.CharField(required=False, strip=False, widget=forms.HiddenInput)

    def clean_shown_name(self):
        if "shown_name" not in self.data:
            return None
        return self.cleaned_data.get("shown_name") or ""


class _DefaultedDateField(forms.DateField):
    """A date box that shows its initial value when the query leaves it out (?days=7 starts today)."""

    def bound_data(self, data, initial):
        return data or initial


class _DefaultedTypedChoiceField(forms.TypedChoiceField):
    """A choice box that shows its initial choice when the query leaves it out (?pool=h100 draws the default
    span, so the box says that span rather than its first option)."""

    def bound_data(self, data, initial):
        return data or initial


class FleetWindowForm(forms.Form):
    DAYS = ((1, "1 day"), (3, "3 days"), (7, "7 days"), (14, "14 days"))

    start = _DefaultedDateField(label="From", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    days = _DefaultedTypedChoiceField(label="Span", choices=DAYS, coerce=int, required=False, empty_value=3)
    pool = forms.ModelChoiceField(queryset=Pool.objects.order_by("name"), to_field_name="name", required=False,
                                  empty_label="All pools", label="Pool")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The filter shows the window window() falls back to, not an empty date and the first span ("1 day").
        self.fields["start"].initial = timezone.localdate
        self.fields["days"].initial = 3

    def clean_start(self):
        day = self.cleaned_data.get("start")
        if day is not None and not DATETIME_MIN.date() <= day < DATETIME_MAX.date():
            raise forms.ValidationError(RANGE_MESSAGE, code="range")
        return day

    def window(self) -> tuple[datetime, datetime]:
        """Return [local midnight of start, local midnight days later) in UTC: DST days are 23 or 25 h."""
        tz = timezone.get_current_timezone()
        # The fields that are valid still count when another is not (a bad date keeps the pool);
        # the page shows the errors of the others and falls back to their defaults.
        self.is_valid()
        data = getattr(self, "cleaned_data", {})
        day = data.get("start") or timezone.localdate()
        days = data.get("days") or 3
        lo = datetime.combine(day, datetime.min.time(), tzinfo=tz)
        hi = datetime.combine(day + timedelta(days=days), datetime.min.time(), tzinfo=tz)
        return lo.astimezone(UTC), hi.astimezone(UTC)


class CalendarWindowForm(forms.Form):
    """The query of the calendar's JSON feeds: start/end as FullCalendar sends them."""

    start = ZonedDateTimeField()
    end = ZonedDateTimeField()
    pool = forms.ModelChoiceField(queryset=Pool.objects.all(), to_field_name="name", required=False)
    granularity = forms.ChoiceField(choices=(("slot", "slot"), ("day", "day")), required=False)

    MAX_SPAN = timedelta(days=62)

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end:
            if end <= start:
                self.add_error("end", "Must be after start.")
            elif end - start > self.MAX_SPAN:
                self.add_error("end", "At most 62 days at a time.")
        return data


class ReservationListForm(forms.Form):
    """Filters of the reservations list: status, pool, who booked, a name search."""

    STATUS_CHOICES = [("", "Any status"), ("current", "Active and upcoming"),
                      *[(value, label) for value, label in ReservationStatus.choices]]

    status = forms.ChoiceField(label="Status", choices=STATUS_CHOICES, required=False)
    pool = forms.ModelChoiceField(queryset=Pool.objects.order_by("name"), to_field_name="name", required=False,
                                  empty_label="All pools", label="Pool")
    mine = forms.BooleanField(label="Booked by me", required=False)
    q = forms.CharField(label="Name contains", max_length=200, required=False)

    def filter(self, qs, *, user, now):
        """The reservations that pass the valid filters (an invalid one is ignored, and shown as an error)."""
        self.is_valid()
        data = getattr(self, "cleaned_data", {})
        status = data.get("status")
        if status == "current":
            qs = qs.filter(status__in=HOLDING_STATUSES, period__endswith__gt=now)
        elif status:
            qs = qs.filter(status=status)
        if data.get("pool"):
            qs = qs.filter(pool=data["pool"])
        if data.get("mine"):
            qs = qs.filter(created_by=user)
        if data.get("q"):
            qs = qs.filter(name__icontains=data["q"])
        return qs
