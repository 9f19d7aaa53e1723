"""Create the demo fleet, tenants, users, quotas and two weeks of bookings. Safe to run again."""

import random
import secrets
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from portal.core.exceptions import DomainError
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
        User = get_user_model()
        with transaction.atomic():
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
            for slug, tname, burst, vlan, cidr, quotas in TENANTS:
                tenant, _ = Tenant.objects.get_or_create(slug=slug, defaults={
                    "name": tname, "burst_enabled": burst, "vlan_id": vlan, "cidr": cidr,
                    "ical_token": secrets.token_urlsafe(24)})
                for role in ("lead", "member", "viewer"):
                    user, created = User.objects.get_or_create(username=f"{slug}-{role}",
                                                               defaults={"email": f"{slug}-{role}@example.com"})
                    if created:
                        user.set_password(PASSWORD)
                        user.save()
                    Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": role})
                for pool_name, (max_nodes, burst_nodes, hours) in quotas.items():
                    Quota.objects.get_or_create(tenant=tenant, pool=Pool.objects.get(name=pool_name), defaults={
                        "max_nodes": max_nodes, "burst_nodes": burst_nodes, "max_duration_hours": hours})
        made = 0 if no_bookings else self._bookings()
        self.stdout.write(self.style.SUCCESS(
            f"Demo fleet: {Node.objects.count()} nodes in {Pool.objects.count()} pools, "
            f"{Tenant.objects.count()} tenants, {Reservation.objects.count()} reservations ({made} new)."
        ))
        self.stdout.write(f"Logins (password for all: {PASSWORD}): admin (staff), "
                          + ", ".join(f"{t[0]}-lead/-member/-viewer" for t in TENANTS))

    def _bookings(self) -> int:
        """Book two weeks of sample reservations through the real service (rules and all)."""
        rng = random.Random(2026)
        now = timezone.now()
        made = 0
        for slug, _name, _burst, _vlan, _cidr, quotas in TENANTS:
            tenant = Tenant.objects.get(slug=slug)
            if Reservation.objects.filter(tenant=tenant, period__endswith__gt=now).exists():
                continue
            lead = get_user_model().objects.get(username=f"{slug}-lead")
            for pool_name, (max_nodes, _b, max_hours) in quotas.items():
                pool = Pool.objects.get(name=pool_name)
                cursor = slot_floor(now, pool.slot_minutes) + timedelta(hours=rng.randint(0, 6))
                while cursor < now + timedelta(days=14):
                    hours = min(rng.choice([4, 8, 12, 24, 48]), max_hours or 48)
                    try:
                        reservation_create(
                            actor=lead, tenant=tenant, pool=pool, node_count=rng.randint(1, max(1, max_nodes // 2)),
                            start=cursor, end=cursor + timedelta(hours=hours),
                            name=rng.choice(["pretrain", "eval sweep", "ablation", "serving canary", "rlhf"]),
                            orchestrator=rng.choice(["slurm", "kubernetes"]),
                        )
                        made += 1
                    except DomainError:
                        pass
                    cursor += timedelta(hours=hours + rng.randint(2, 30))
        return made
