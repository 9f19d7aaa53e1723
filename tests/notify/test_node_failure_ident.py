"""A node failure is announced once, named by its repair when it has one (found in a review: a later failure of
a node whose old repair had closed was taken for that old one and never announced)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from notifications import services
from notifications.models import Delivery
from provisioning.health.models import Repair
from reservations import services as booking
from reservations.models import Node

pytestmark = pytest.mark.django_db


def test_a_new_manual_failure_after_an_old_closed_repair_is_announced(world, settings, notify_settings):
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    node = world.nodes[0]
    # Months ago: health checks failed the node, repair #R was announced, remediated and rejoined.
    old = Repair.objects.create(node=node, reason="XID 79", state="rejoined",
                                opened_at=timezone.now() - timedelta(days=90),
                                closed_at=timezone.now() - timedelta(days=89))
    first = services.event_fanout(event="node.failed", payload={"node_id": node.pk, "repair_id": old.pk})
    assert len(first) == 1
    # Today: staff marks the node failed by hand (no repair): node.state_changed → failed.
    booking.node_update(actor=world.users["staff"], node=Node.objects.get(pk=node.pk), state="failed",
                        reason="PSU dead")
    second = services.event_fanout(event="node.state_changed",
                                   payload={"node_id": node.pk, "old": "available", "new": "failed"})
    assert len(second) == 1, list(Delivery.objects.values_list("key", flat=True))


def test_a_repair_ending_as_failed_and_its_nodes_state_change_are_one_failure(world, settings, notify_settings):
    settings.PORTAL_PLATFORM_SLACK_WEBHOOK = "https://hooks.slack.com/services/T9/B9/platform"
    node = world.nodes[1]
    repair = Repair.objects.create(node=node, reason="XID 48", state="failed", opened_at=timezone.now(),
                                   closed_at=timezone.now())
    booking.node_update(actor=world.users["staff"], node=Node.objects.get(pk=node.pk), state="failed",
                        reason=f"repair #{repair.pk}: failed")
    first = services.event_fanout(event="node.failed", payload={"node_id": node.pk, "repair_id": repair.pk})
    again = services.event_fanout(event="node.state_changed",
                                  payload={"node_id": node.pk, "old": "draining", "new": "failed"})
    assert len(first) == 1 and again == []
