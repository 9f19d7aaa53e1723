from django.apps import AppConfig


class HealthConfig(AppConfig):
    name = "provisioning.health"
    label = "health"
    verbose_name = "GPU health"

    def ready(self) -> None:
        # An open repair owns its node: node_update refuses to make it available (for staff and workers
        # alike) until the repair rejoins it. reservations never imports us (DESIGN §2): we register.
        from reservations.services import node_return_blockers

        from .services import node_return_blocker

        if node_return_blocker not in node_return_blockers:
            node_return_blockers.append(node_return_blocker)
