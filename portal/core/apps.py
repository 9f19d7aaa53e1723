from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "portal.core"
    label = "core"
    verbose_name = "Core"

    def ready(self):
        from . import schema  # noqa: F401 - registers the scoped slug field with drf-spectacular
