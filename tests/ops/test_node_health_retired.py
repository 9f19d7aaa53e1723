"""portal_node_health counts the fleet's nodes by their latest verdict: a node taken out of the fleet
for good (retired) is no longer one of them, as portal_gpus already leaves it out."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.apps import apps
from django.test import Client

from reservations.models import Node
from tests.conftest import make_world

from .conftest import scrape

pytestmark = pytest.mark.django_db


def test_a_retired_node_no_longer_counts_as_a_failed_node(ops):
    HealthCheck = apps.get_model("health", "HealthCheck")
    world = make_world(nodes=3)
    broken, fine = world.nodes[:2]
    t0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    HealthCheck.objects.create(node=broken, level="quick", trigger="schedule", status="done", verdict="fail",
                               finished_at=t0)
    HealthCheck.objects.create(node=fine, level="quick", trigger="schedule", status="done", verdict="pass",
                               finished_at=t0)
    assert scrape(Client()).value("portal_node_health", pool="h100", verdict="fail") == 1
    # The failed node is replaced and retired: the fleet has no failed node left.
    Node.objects.filter(pk=broken.pk).update(state="retired")
    s = scrape(Client())
    assert s.value("portal_node_health", pool="h100", verdict="fail") == 0
    assert s.value("portal_node_health", pool="h100", verdict="pass") == 1
    assert s.value("portal_gpus", pool="h100", state="failed") == 0
