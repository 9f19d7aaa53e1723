from django.apps import AppConfig


class ReservationsConfig(AppConfig):
    name = "reservations"

    def ready(self) -> None:
        from tenants.services import slug_guard_register

        slug_guard_register(_slug_names_bookings)


def _slug_names_bookings(tenant) -> str | None:
    """A tenant that has booked is known by its slug in the backends (Slurm reservation names and
    accounts, Kubernetes namespaces and node taints, kept per cluster until torn down and beyond):
    renaming it would strand those objects, or hand them to a new tenant that takes the old slug."""
    from .models import Reservation

    if Reservation.objects.filter(tenant=tenant).exists():
        return f"tenant {tenant.slug} has bookings, and the clusters' backends know it by this slug"
    return None
