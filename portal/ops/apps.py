from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "portal.ops"
    label = "ops"
    verbose_name = "Operations"

    def ready(self) -> None:
        from . import logging as ops_logging
        from . import metrics

        metrics.install()
        from portal.core.instrument import booking_finished

        booking_finished.connect(metrics.on_booking_finished, dispatch_uid="ops-booking-metrics")
        ops_logging.install_celery_hooks()
