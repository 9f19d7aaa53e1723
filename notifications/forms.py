"""HTML forms for a lead's notification settings. They validate shape; the services decide."""

from __future__ import annotations

from django import forms

from portal.core.egress import MAX_URL_LENGTH

from .choices import EVENT_LABELS, SUBSCRIBABLE_EVENTS, DeliveryStatus

__all__ = ["SlackUrlForm", "EventsForm", "WebhookForm", "WebhookEditForm", "DeliveryFilterForm", "EVENT_CHOICES"]

EVENT_CHOICES = [(e, EVENT_LABELS[e]) for e in SUBSCRIBABLE_EVENTS]


class _OwnIds:
    """Element ids of the form's own (ID_FORMAT): the settings page shows the Slack forms and "Add a webhook"
    together, and with Django's default id_url / id_events_N for both, a label named (and a click on it
    ticked) the other form's field. Ids only: the POSTed names stay url, events, enabled, clear."""

    ID_FORMAT = "id_%s"

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_id", self.ID_FORMAT)
        super().__init__(*args, **kwargs)


class SlackUrlForm(_OwnIds, forms.Form):
    ID_FORMAT = "slack-%s"
    # Never pre-filled: the current URL is a secret and is only ever shown masked.
    url = forms.URLField(
        required=False, max_length=MAX_URL_LENGTH, assume_scheme="https", label="Slack incoming-webhook URL",
        widget=forms.TextInput(attrs={"autocomplete": "off", "placeholder": "https://hooks.slack.com/services/…"}),
    )
    clear = forms.BooleanField(required=False, label="Remove the Slack webhook")

    def clean(self):
        data = super().clean()
        # Only when nothing was given: a URL that is not one already has its own reason beside the field.
        if not data.get("url") and not data.get("clear") and "url" not in self.errors:
            raise forms.ValidationError("Paste the new URL, or tick “Remove”.")
        return data


class EventsForm(_OwnIds, forms.Form):
    ID_FORMAT = "slack-events-%s"
    events = forms.MultipleChoiceField(choices=EVENT_CHOICES, required=False, widget=forms.CheckboxSelectMultiple)
    enabled = forms.BooleanField(required=False)


class WebhookForm(_OwnIds, forms.Form):
    ID_FORMAT = "new-webhook-%s"
    name = forms.CharField(max_length=100, required=False)
    url = forms.URLField(max_length=MAX_URL_LENGTH, assume_scheme="https", label="Endpoint URL",
                         widget=forms.TextInput(attrs={"autocomplete": "off",
                                                       "placeholder": "https://ci.example.com/hooks/gpu-portal"}))
    events = forms.MultipleChoiceField(choices=EVENT_CHOICES, required=False, widget=forms.CheckboxSelectMultiple,
                                       initial=list(SUBSCRIBABLE_EVENTS))


class WebhookEditForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)
    url = forms.URLField(max_length=MAX_URL_LENGTH, assume_scheme="https", required=False, label="New endpoint URL",
                         widget=forms.TextInput(attrs={"autocomplete": "off"}))
    events = forms.MultipleChoiceField(choices=EVENT_CHOICES, required=False, widget=forms.CheckboxSelectMultiple)
    enabled = forms.BooleanField(required=False)


class DeliveryFilterForm(forms.Form):
    status = forms.ChoiceField(choices=[("", "any status"), *DeliveryStatus.choices], required=False)
