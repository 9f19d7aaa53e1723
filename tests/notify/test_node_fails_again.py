"""A node that failed in a booking, came back as its spare and failed again is announced again (found in a
review: both failures were named by the booking and the node alone, so the second was taken for the first and
the team never heard of it). The one failure's reservation.degraded and cluster.degraded stay one message, and
an event handed over again adds nothing. Real flow: the swaps, the cluster's task (eager) and the Slack receiver."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Q

from notifications import services
from notifications.slack import Event
from provisioning import services as provisioning
from provisioning.choices import ClusterStatus
from provisioning.models import VirtualCluster
from reservations.choices import NodeState
from reservations.models import Allocation, Node
from reservations.services import node_update

pytestmark = pytest.mark.django_db

NODE_EVENTS = ("reservation.degraded", "node.replaced", "cluster.degraded")


def _set(world, node: Node, state: str, django_capture_on_commit_callbacks) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        node_update(actor=world.users["staff"], node=Node.objects.get(pk=node.pk), state=state, reason="XID 79")
        provisioning.node_sync(node_id=node.pk)


def test_a_node_failing_again_in_the_same_booking_is_announced_again(
        world, t0, book, receiver, slack_for, settings, eager, captured_events, django_capture_on_commit_callbacks):
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    settings.PORTAL_SIMULATED_PHASE_SECONDS = "0"
    settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.001
    reservation = book("alpha", t0, nodes=2)
    with django_capture_on_commit_callbacks(execute=True):
        provisioning.lifecycle_tick(now=t0 - timedelta(minutes=10))
        cluster = VirtualCluster.objects.get(reservation=reservation)
        assert provisioning.cluster_provision(cluster_id=cluster.pk) == ClusterStatus.READY
    first, second = Node.objects.filter(allocations__reservation=reservation).order_by("hostname")
    others = Node.objects.exclude(Q(pk=first.pk) | Q(pk=second.pk))
    others.update(state=NodeState.MAINTENANCE)  # no spare

    _set(world, first, NodeState.FAILED, django_capture_on_commit_callbacks)  # degraded: 1 missing
    _set(world, first, NodeState.AVAILABLE, django_capture_on_commit_callbacks)  # repaired, free again
    _set(world, second, NodeState.FAILED, django_capture_on_commit_callbacks)  # `first` is its spare
    assert Allocation.objects.filter(reservation=reservation, node=first, active=True).exists()
    _set(world, first, NodeState.FAILED, django_capture_on_commit_callbacks)  # and fails again: 2 missing
    told = [(name, payload) for name, payload in captured_events if name in NODE_EVENTS]
    assert [name for name, _ in told] == ["reservation.degraded", "cluster.degraded", "node.replaced",
                                          "reservation.degraded"], told

    # Notifications hears of them only now (the outbox hands them over), each twice (a redelivery).
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"), events=[Event.CLUSTER_DEGRADED])
    created = [d for _ in range(2) for name, payload in told
               for d in services.event_fanout(event=name, payload=payload)]

    assert [d.event for d in created] == [Event.CLUSTER_DEGRADED, Event.CLUSTER_DEGRADED]
    for delivery in created:
        assert services.delivery_send(delivery_id=delivery.pk).status == "delivered"
    bodies = [request.body.decode() for request in receiver.wait_for(2)]
    assert all(first.hostname in body for body in bodies)
    assert "1 node missing" in bodies[0] and "2 nodes missing" in bodies[1], bodies


def test_the_same_pair_of_nodes_swapped_again_in_a_booking_is_announced_again(
        world, t0, book, receiver, slack_for, settings, eager, captured_events, django_capture_on_commit_callbacks):
    settings.PORTAL_NOTIFY_MIN_INTERVAL = 0.001
    reservation = book("alpha", t0, nodes=1)
    (first,) = Node.objects.filter(allocations__reservation=reservation)
    second = Node.objects.exclude(pk=first.pk).order_by("hostname").first()
    Node.objects.exclude(Q(pk=first.pk) | Q(pk=second.pk)).update(state=NodeState.MAINTENANCE)

    for failing, back in ((first, first), (second, second), (first, None)):  # first → second → first → second
        _set(world, failing, NodeState.FAILED, django_capture_on_commit_callbacks)
        if back is not None:
            _set(world, back, NodeState.AVAILABLE, django_capture_on_commit_callbacks)
    told = [payload for name, payload in captured_events if name == "node.replaced"]
    assert [(p["failed"], p["spare"]) for p in told] == [(first.hostname, second.hostname),
                                                         (second.hostname, first.hostname),
                                                         (first.hostname, second.hostname)]

    slack_for("alpha", receiver.url("/services/T0/B0/alpha"), events=[Event.NODE_REPLACED])
    created = [d for _ in range(2) for payload in told
               for d in services.event_fanout(event="node.replaced", payload=payload)]

    assert len(created) == 3  # each swap once, the redelivered events nothing
    for delivery in created:
        assert services.delivery_send(delivery_id=delivery.pk).status == "delivered"
    assert len(receiver.wait_for(3)) == 3
