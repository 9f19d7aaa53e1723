from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ReservationsConfig(AppConfig):
    name = "reservations"

    def ready(self) -> None:
        from tenants.services import slug_guard_register

        slug_guard_register(_slug_names_bookings)
        post_migrate.connect(_install_booking_function, sender=self)


def _install_booking_function(using: str = "default", **kwargs) -> None:
    """Every migrate (and a test database's flush) makes sure this release's booking function exists."""
    from .services import install_booking_function

    install_booking_function(using)


def _slug_names_bookings(tenant) -> str | None:
    """A tenant that has booked is known by its slug in the backends (Slurm reservation names and
    accounts, Kubernetes namespaces and node taints, kept per cluster until torn down and beyond):
    renaming it would strand those objects, or hand them to a new tenant that takes the old slug."""
    from .models import Reservation

    if Reservation.objects.filter(tenant=tenant).exists():
        return f"tenant {tenant.slug} has bookings, and the clusters' backends know it by this slug"
    return None
