from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "provisioning"

    def ready(self) -> None:
        # reservations never imports provisioning (DESIGN §2): we listen to its events instead.
        from . import handlers

        handlers.connect()
