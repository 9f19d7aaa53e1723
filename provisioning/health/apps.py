from django.apps import AppConfig


class HealthConfig(AppConfig):
    name = "provisioning.health"
    label = "health"
    verbose_name = "GPU health"
