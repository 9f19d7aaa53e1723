from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "notifications"
    verbose_name = "Notifications"

    def ready(self) -> None:
        from portal.core import events

        from .subscribers import on_event

        # One subscriber for everything: it translates the events it knows and ignores the rest,
        # so events added by other apps later are safe until someone maps them.
        events.subscribe("*", on_event, background=True)
