"""Subscribers to the domain events of lower apps (reservations): they only create rows and enqueue.

Each handler runs after the emitting transaction committed. If one fails (or its message
is lost), the lifecycle tick and ``manage.py reconcile`` find the difference later.
"""

from __future__ import annotations

import logging
from typing import Any

from portal.core import events

logger = logging.getLogger(__name__)


def on_reservation_confirmed(event: str, payload: dict[str, Any]) -> None:
    from .services import cluster_create_for_reservation

    cluster_create_for_reservation(reservation_id=payload["reservation_id"])


def on_reservation_changed(event: str, payload: dict[str, Any]) -> None:
    """Converge the backend's copy of the booking here, in the outbox worker (a background subscriber).

    Not by queueing provisioning.sync_reservation: the outbox row is deleted when this returns, so a
    sync message lost after that (Redis restarted, the broker refused it and _send logged it) was
    never sent again — nothing else resends syncs. A failure or a busy cluster (RetryLater) raises,
    and the outbox runs the event again after its backoff; reservation_sync is level-triggered.
    """
    from .services import reservation_sync

    reservation_sync(reservation_id=payload["reservation_id"])


def on_reservation_cancelled(event: str, payload: dict[str, Any]) -> None:
    from django.utils import timezone

    from .models import VirtualCluster
    from .services import _enqueue

    cluster_id = VirtualCluster.objects.filter(reservation_id=payload["reservation_id"]).values_list(
        "id", flat=True).first()
    if cluster_id is not None:
        VirtualCluster.objects.filter(pk=cluster_id).update(dispatched_at=timezone.now())
        _enqueue("teardown_cluster", cluster_id)


def on_node_state_changed(event: str, payload: dict[str, Any]) -> None:
    from .services import _enqueue

    _enqueue("node_changed", payload["node_id"])


def on_node_replaced(event: str, payload: dict[str, Any]) -> None:
    from .services import _enqueue

    _enqueue("cluster_nodes_changed", payload["reservation_id"], payload["failed"], payload["spare"],
             payload.get("allocation_id"))


def on_reservation_degraded(event: str, payload: dict[str, Any]) -> None:
    from .services import _enqueue

    _enqueue("cluster_nodes_changed", payload["reservation_id"], payload["node"], None, payload.get("allocation_id"))


def connect() -> None:
    # Creating the cluster is a transaction of its own: a worker does it, not the booking request.
    # (Any lost message is repaired by the lifecycle tick, which creates missing clusters.)
    events.subscribe("reservation.confirmed", on_reservation_confirmed, background=True)
    # Through the outbox: a window change whose sync message was lost (the process died right after
    # the commit) would otherwise reach the backend only with `manage.py reconcile`.
    events.subscribe("reservation.changed", on_reservation_changed, background=True)
    events.subscribe("reservation.cancelled", on_reservation_cancelled)
    events.subscribe("node.state_changed", on_node_state_changed)
    # reservations.node_replace_allocations moved a booking off a failed node (ours or the health checks').
    events.subscribe("node.replaced", on_node_replaced)
    events.subscribe("reservation.degraded", on_reservation_degraded)
