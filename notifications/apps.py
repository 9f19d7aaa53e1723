from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "notifications"
    verbose_name = "Notifications"

    def ready(self) -> None:
        from portal.core import events
        from portal.core.templatetags.audit import value_words_add

        from .choices import EVENT_LABELS
        from .subscribers import on_event

        # The audit page words a channel's events as its pages do ("Reservation confirmed").
        value_words_add("events", EVENT_LABELS)

        # One subscriber for everything: it translates the events it knows and ignores the rest,
        # so events added by other apps later are safe until someone maps them.
        events.subscribe("*", on_event, background=True)
