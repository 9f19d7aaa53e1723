"""Create the demo fleet, tenants, users, quotas and two weeks of bookings. Safe to run again, and a run
cut off part-way is completed by the next."""

import random
import secrets
from datetime import UTC, datetime, time, timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from portal.core.exceptions import DomainError
from portal.core.models import AuditLog
from reservations.models import Node, Pool, Reservation
from reservations.services import reservation_create
from reservations.timeutil import slot_floor
from tenants.models import Membership, Quota, Tenant

POOLS = [
    # name, gpu model, nodes, gpus per node, on-demand rate per GPU-hour
    ("h100-sxm", "H100-SXM", 32, 8, "4.50"),
    ("a100-80gb", "A100-80GB", 16, 8, "2.20"),
    ("l40s", "L40S", 16, 4, "1.10"),
]
TENANTS = [
    # slug, name, burst, VLAN, CIDR, {pool: (max_nodes, burst_nodes, max_duration_hours)}
    ("research", "Research", True, 101, "10.101.0.0/16",
     {"h100-sxm": (12, 4, None), "a100-80gb": (6, 2, None), "l40s": (4, 0, 72)}),
    ("inference", "Inference", False, 102, "10.102.0.0/16",
     {"h100-sxm": (6, 0, 168), "l40s": (10, 0, None)}),
    ("finetune", "Fine-tuning", True, 103, "10.103.0.0/16",
     {"h100-sxm": (8, 4, 72), "a100-80gb": (8, 4, None)}),
]
PASSWORD = "demo-portal-2026"  # noqa: S105 — printed for the demo; never used outside make run


class Command(BaseCommand):
    help = "Seed the demo fleet (idempotent): pools, nodes, tenants with lead/member/viewer, quotas, bookings."

    def add_arguments(self, parser):
        parser.add_argument("--no-bookings", action="store_true")

    def handle(self, *args, no_bookings=False, **options):
        # Each step is atomic and finds what an earlier run made: a run cut off part-way (an error, a
        # killed process) leaves whole steps behind, and the next run completes the rest.
        with transaction.atomic():
            self._fleet()
        made = 0
        for spec in TENANTS:
            with transaction.atomic():
                tenant, lead = self._tenant(*spec)
            if not no_bookings:
                made += self._bookings(tenant=tenant, lead=lead, quotas=spec[5])
        self.stdout.write(self.style.SUCCESS(
            f"Demo fleet: {Node.objects.count()} nodes in {Pool.objects.count()} pools, "
            f"{Tenant.objects.count()} tenants, {Reservation.objects.count()} reservations ({made} new)."
        ))
        self.stdout.write(f"Logins (password for all: {PASSWORD}): admin (staff), "
                          + ", ".join(f"{t[0]}-lead/-member/-viewer" for t in TENANTS))

    def _fleet(self) -> None:
        User = get_user_model()
        for name, model, count, gpus, rate in POOLS:
            pool, _ = Pool.objects.get_or_create(
                name=name, defaults={"gpu_model": model, "gpus_per_node": gpus, "on_demand_rate": rate}
            )
            for i in range(1, count + 1):
                Node.objects.get_or_create(
                    hostname=f"{name}-{i:03d}", defaults={
                        "pool": pool,
                        "gpus": [{"index": g, "uuid": f"GPU-{name}-{i:03d}-{g}", "serial": f"SN{i:03d}{g}"}
                                 for g in range(gpus)],
                    }
                )
        admin, created = User.objects.get_or_create(username="admin", defaults={"is_staff": True,
                                                                                "is_superuser": True})
        if created:
            admin.set_password(PASSWORD)
            admin.save()

    def _tenant(self, slug, tname, burst, vlan, cidr, quotas):
        """The tenant, its lead/member/viewer and its quotas, whichever of them are missing."""
        User = get_user_model()
        tenant, _ = Tenant.objects.get_or_create(slug=slug, defaults={
            "name": tname, "burst_enabled": burst, "vlan_id": vlan, "cidr": cidr,
            "ical_token": secrets.token_urlsafe(24)})
        users = {}
        for role in ("lead", "member", "viewer"):
            user, created = User.objects.get_or_create(username=f"{slug}-{role}",
                                                       defaults={"email": f"{slug}-{role}@example.com"})
            if created:
                user.set_password(PASSWORD)
                user.save()
            Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": role})
            users[role] = user
        for pool_name, (max_nodes, burst_nodes, hours) in quotas.items():
            Quota.objects.get_or_create(tenant=tenant, pool=Pool.objects.get(name=pool_name), defaults={
                "max_nodes": max_nodes, "burst_nodes": burst_nodes, "max_duration_hours": hours})
        return tenant, users["lead"]

    def _bookings(self, *, tenant: Tenant, lead, quotas: dict) -> int:
        """Book the tenant's two weeks of sample reservations through the real service (rules and all).

        Each booking is its own transaction (the service's), so the weeks cannot be booked atomically;
        instead they follow a plan fixed by the day the tenant's current bookings were first made, and
        a window of the plan already booked is not booked again. A run cut off part-way is completed
        by the next; a run over complete bookings books nothing; once all of a tenant's bookings have
        ended, a run books two fresh weeks.
        """
        now = timezone.now()
        made = 0
        for pool_name, (max_nodes, _b, max_hours) in quotas.items():
            pool = Pool.objects.get(name=pool_name)
            booked = _booked_windows(tenant, pool)
            for start, end, node_count, name, orchestrator in self._plan(tenant, pool, max_nodes, max_hours, now):
                if start < slot_floor(now, pool.slot_minutes):
                    continue  # the plan's past: never booked again
                if (start, end) in booked:
                    continue
                try:
                    reservation_create(actor=lead, tenant=tenant, pool=pool, node_count=node_count,
                                       start=start, end=end, name=name, orchestrator=orchestrator)
                    made += 1
                except DomainError:
                    pass
        return made

    def _plan(self, tenant: Tenant, pool: Pool, max_nodes: int, max_hours: int | None, now) -> list[tuple]:
        """The tenant's windows in pool for the plan of the day its still-running or future bookings
        were first made (today if it has none): the same list on every run that day's plan is used."""
        first = (Reservation.objects.filter(tenant=tenant, period__endswith__gt=now)
                 .order_by("created_at").values_list("pk", "created_at", "period", "pool_id").first())
        if first is None:
            return _plan_for(tenant.slug, pool, max_nodes, max_hours, now.date())
        first_pk, created_at, period, pool_id = first
        # The window the plan booked, though the booking may have been moved since.
        booked = _booked_as([first_pk]).get(first_pk, (period.lower, period.upper))
        day = created_at.astimezone(UTC).date()
        # A run that began just before midnight made its first booking after it, under the day before:
        # the plan is the one that has that booking's window.
        first_pool = Pool.objects.get(pk=pool_id)
        first_quota = next((t[5] for t in TENANTS if t[0] == tenant.slug), {}).get(first_pool.name)
        for candidate in (day, day - timedelta(days=1)):
            if first_quota and any(
                    (s, e) == booked
                    for s, e, *_ in _plan_for(tenant.slug, first_pool, first_quota[0], first_quota[2], candidate)):
                return _plan_for(tenant.slug, pool, max_nodes, max_hours, candidate)
        return _plan_for(tenant.slug, pool, max_nodes, max_hours, day)


def _booked_as(reservation_ids: list[int]) -> dict[int, tuple[datetime, datetime]]:
    """The window each booking was made for (its reservation.create audit row), wherever it is now."""
    rows = AuditLog.objects.filter(action="reservation.create", object_type=Reservation._meta.label_lower,
                                   object_id__in=[str(pk) for pk in reservation_ids])
    return {int(object_id): (datetime.fromisoformat(after["start"]), datetime.fromisoformat(after["end"]))
            for object_id, after in rows.values_list("object_id", "after")
            if "start" in after and "end" in after}


def _booked_windows(tenant: Tenant, pool: Pool) -> set[tuple[datetime, datetime]]:
    """The windows of tenant's bookings in pool, each both where it is now and where it was booked: a plan
    window whose booking has since been moved (an edit, the portal's own changes) is booked already."""
    periods = dict(Reservation.objects.filter(tenant=tenant, pool=pool).values_list("pk", "period"))
    return {(p.lower, p.upper) for p in periods.values()} | set(_booked_as(list(periods)).values())


def _plan_for(slug: str, pool: Pool, max_nodes: int, max_hours: int | None, day) -> list[tuple]:
    """Two weeks of windows from midnight (UTC) of day: the same for the same tenant, pool and day."""
    rng = random.Random(f"{slug}/{pool.name}/{day.isoformat()}")
    midnight = datetime.combine(day, time.min, tzinfo=UTC)
    cursor = slot_floor(midnight, pool.slot_minutes) + timedelta(hours=rng.randint(0, 6))
    windows = []
    while cursor < midnight + timedelta(days=14):
        hours = min(rng.choice([4, 8, 12, 24, 48]), max_hours or 48)
        windows.append((cursor, cursor + timedelta(hours=hours), rng.randint(1, max(1, max_nodes // 2)),
                        rng.choice(["pretrain", "eval sweep", "ablation", "serving canary", "rlhf"]),
                        rng.choice(["slurm", "kubernetes"])))
        cursor += timedelta(hours=hours + rng.randint(2, 30))
    return windows
