from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "provisioning"

    def ready(self) -> None:
        # reservations never imports provisioning (DESIGN §2): we listen to its events instead.
        from reservations.services import window_change_guards

        from . import handlers
        from .services import storage_window_guard

        handlers.connect()
        # A booking's window change is judged against the tenant's storage quota, as configuring its cluster is.
        if storage_window_guard not in window_change_guards:
            window_change_guards.append(storage_window_guard)
