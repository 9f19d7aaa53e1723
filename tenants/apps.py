from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"

    def ready(self) -> None:
        from . import schema  # noqa: F401 - registers the Bearer scheme with drf-spectacular
