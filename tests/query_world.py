"""A world of size n for the query-count tests: bookings with nodes, clusters, checks, repairs, deliveries, audit."""
from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from psycopg.types.range import Range

from notifications.models import Channel, Delivery
from portal.core.models import AuditLog
from provisioning.health.models import HealthCheck, Repair
from provisioning.models import ClusterTransition, VirtualCluster
from reservations.models import Allocation, Node, Reservation
from reservations.timeutil import slot_floor


def grow(world, n: int):
    """n reservations (each 1 node, own node) for alpha, clusters, checks, repairs, deliveries, audit rows."""
    now = slot_floor(timezone.now(), 60)
    pool = world.pool
    alpha = world.tenants["alpha"]
    lead = world.users["alpha-lead"]
    nodes = [Node.objects.create(hostname=f"x-{n}-{i:03d}", pool=pool) for i in range(n)]
    ch = Channel.objects.create(tenant=alpha, kind="webhook", name="wh", url="https://example.com/h")
    out = []
    for i, node in enumerate(nodes):
        period = Range(now - timedelta(hours=1), now + timedelta(hours=3), "[)")
        r = Reservation.objects.create(tenant=alpha, pool=pool, node_count=1, period=period, name=f"r{i}",
                                       status="active", created_by=lead)
        Allocation.objects.create(reservation=r, node=node, period=period)
        c = VirtualCluster.objects.create(reservation=r, tenant=alpha, status="ready", backend="simulated",
                                          orchestrator="slurm", orchestrator_version="24.11",
                                          cuda_version="12.8", default_memory_per_gpu_gib=80,
                                          shared_storage_gib=100)
        ClusterTransition.objects.create(cluster=c, phase="pending")
        ClusterTransition.objects.create(cluster=c, phase="ready", previous="pending", actor=lead)
        hc = HealthCheck.objects.create(node=node, reservation=r, level="quick", trigger="tenant",
                                        status="done", verdict="fail", requested_by=lead,
                                        finished_at=timezone.now())
        Repair.objects.create(node=node, reason="x", triggering_check=hc, opened_by=lead)
        Delivery.objects.create(key=f"k-{n}-{i}", channel=ch, channel_label="wh", kind="webhook", tenant=alpha,
                                event="reservation.created", message_id=f"m{i}", body="{}")
        AuditLog.objects.create(actor=lead, action="reservation.created", object_type="reservations.reservation",
                                object_id=str(r.pk), tenant_id=alpha.pk)
        out.append((r, c, hc, node))
    return out
