"""Fixtures for the health flow through the database: a small fleet, bookings, an eager Celery.

Checks are requested through the services, sent by ``dispatch`` through Celery (eager here, a
real worker in test_worker.py) to the simulated fleet, whose faults come from PORTAL_FAKE_NVML
exactly as in the demo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from reservations.models import Allocation, Node, Pool, Reservation
from reservations.timeutil import slot_floor
from tenants.models import Membership, Quota, Tenant
from tenants.services import token_issue

PASSWORD = "pw-Long-enough-1"  # noqa: S105


def fleet_spec(nodes: dict[str, Any] | None = None, **default: Any) -> str:
    """Return PORTAL_FAKE_NVML text: per-host faults (a list) or node specs."""
    return json.dumps({"default": default, "nodes": nodes or {}})


@dataclass
class Fleet:
    pool: Pool
    nodes: list[Node]
    tenants: dict[str, Tenant]
    users: dict[str, Any] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    def node(self, hostname: str) -> Node:
        return Node.objects.get(hostname=hostname)

    def book(self, tenant: str, hostnames: list[str], start, end, status: str = "active") -> Reservation:
        """Book nodes directly (the booking service is tested elsewhere; here we need exact nodes)."""
        reservation = Reservation.objects.create(
            tenant=self.tenants[tenant], pool=self.pool, node_count=len(hostnames),
            period=DateTimeTZRange(start, end, "[)"), status=status, name=f"{tenant} job",
        )
        for host in hostnames:
            Allocation.objects.create(reservation=reservation, node=self.node(host),
                                      period=DateTimeTZRange(start, end, "[)"))
        return reservation

    def client(self, who: str | None):
        from rest_framework.test import APIClient

        client = APIClient()
        if who is not None:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {self.tokens[who]}")
        return client


def make_fleet(*, nodes: int = 4, model: str = "H100-SXM", gpus: int = 8, prefix: str = "gpu",
               users: bool = True) -> Fleet:
    pool = Pool.objects.create(name=f"{prefix}-pool", gpu_model=model, gpus_per_node=gpus)
    node_objs = [Node.objects.create(hostname=f"{prefix}-{i:03d}", pool=pool) for i in range(1, nodes + 1)]
    fleet = Fleet(pool=pool, nodes=node_objs, tenants={})
    User = get_user_model()
    for slug in ("alpha", "beta"):
        tenant = Tenant.objects.create(slug=f"{prefix}-{slug}", name=f"Team {slug}")
        fleet.tenants[slug] = tenant
        Quota.objects.create(tenant=tenant, pool=pool, max_nodes=nodes, burst_nodes=0)
        if not users:
            continue
        for role in ("lead", "member", "viewer"):
            user = User.objects.create_user(username=f"{prefix}-{slug}-{role}", password=PASSWORD)
            Membership.objects.create(user=user, tenant=tenant, role=role)
            fleet.users[f"{slug}-{role}"] = user
    if users:
        fleet.users["staff"] = User.objects.create_user(username=f"{prefix}-staff", password=PASSWORD, is_staff=True)
        for name, user in fleet.users.items():
            fleet.tokens[name] = token_issue(user=user)[1]
    return fleet


@pytest.fixture
def fleet(db) -> Fleet:
    return make_fleet()


@pytest.fixture
def now_slot():
    return slot_floor(timezone.now(), 60)


@pytest.fixture
def tomorrow():
    return slot_floor(timezone.now(), 60) + timedelta(days=1)


def gate_cluster(booking, cuda_version: str = "12.8"):
    """A cluster of booking waiting on its acceptance gate (simulated backend), with the team's CUDA version."""
    from provisioning.models import VirtualCluster

    return VirtualCluster.objects.create(
        reservation=booking, tenant=booking.tenant, status="running_acceptance_tests", backend="simulated",
        orchestrator="slurm", orchestrator_version="24.11", cuda_version=cuda_version, default_memory_per_gpu_gib=80,
        shared_storage_gib=100,
    )
