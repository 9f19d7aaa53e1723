"""A failing check whose consequences were cut short (the worker died after opening the repair) is finished
later by health_maintain — bookings moved, the failure announced — not silently (found in a review)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core import events
from provisioning.health import services as health
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.runner import SimulatedFleet
from reservations.models import Allocation, Node


@pytest.mark.django_db(transaction=True)
def test_a_check_cut_short_after_opening_its_repair_is_finished_and_announced(fleet, now_slot, monkeypatch):
    seen = []
    rec = lambda e, p: seen.append(e)  # noqa: E731
    events.subscribe("*", rec)
    try:
        fleet.book("alpha", ["gpu-001"], now_slot, now_slot + timedelta(hours=3))
        node = fleet.node("gpu-001")
        check = HealthCheck.objects.create(node=node, level="quick", trigger="schedule", status="running")
        report = SimulatedFleet({"nodes": {node.hostname: [{"kind": "remap_failure", "gpu": 4}]}}).run(
            {"id": check.pk, "host": node.hostname, "level": "quick", "model": "H100-SXM", "gpus": 8})
        assert report["verdict"] == "fail"

        def crash(**kw):
            raise RuntimeError("worker lost its DB connection / was killed here")

        monkeypatch.setattr(health, "node_replace_allocations", crash)
        with pytest.raises(RuntimeError):
            health.health_check_record(check.pk, report)
        monkeypatch.undo()
        # health_maintain finishes the check's consequences later (the documented recovery path).
        HealthCheck.objects.filter(pk=check.pk).update(finished_at=check.created_at - timedelta(minutes=5))
        health.health_maintain()
        assert HealthCheck.objects.get(pk=check.pk).handled_at is not None
        assert Repair.objects.filter(node=node).exists()
        assert Node.objects.get(pk=node.pk).state == "draining"
        assert {"node.failed", "health_check.failed"} <= set(seen), seen
        assert not Allocation.objects.filter(node=node, active=True, period__endswith__gt=timezone.now()).exists()
    finally:
        events.unsubscribe("*", rec)
