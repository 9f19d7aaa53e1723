"""The booking's background event subscribers run in a real Celery worker, not in the request."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core import events, tasks
from portal.core.models import OutboxEvent
from provisioning.models import ClusterTransition, VirtualCluster

from .conftest import book, now_slot, purge_queue, start_worker, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def events_worker(tmp_path):
    """A worker on the default queue (core.dispatch_event) and the provisioning queue."""
    for queue in ("default", "provisioning"):
        purge_queue(queue=queue)
    worker = start_worker(tmp_path, queues="default,provisioning")
    yield worker
    worker.stop()


def _succeeded(worker, *results) -> bool:
    """Whether the worker logged each of these task runs as finished.

    Only a line naming the run counts: the startup banner also lists core.dispatch_event, and a
    "received" line comes before the task has done anything.
    """
    output = worker.output()
    return all(f"core.dispatch_event[{result.id}] succeeded" in output for result in results)


def test_the_worker_creates_the_cluster_after_the_booking_commits(world, settings, events_worker, monkeypatch):
    settings.PORTAL_EVENTS_INLINE = False  # as in production: the request only publishes
    emitted: list[tuple[str, dict, int | None]] = []  # (event, payload, outbox id) as committed
    real_after_commit = events._after_commit

    def after_commit(event, payload, outbox_id, *rest):
        emitted.append((event, payload, outbox_id))
        real_after_commit(event, payload, outbox_id, *rest)

    monkeypatch.setattr(events, "_after_commit", after_commit)
    reservation = book(world, "alpha-lead", now_slot(world), hours=2, nodes=2)
    # The booking committed and returned; the cluster is the worker's job.
    cluster = wait_for(lambda: VirtualCluster.objects.filter(reservation=reservation).first(), timeout=60,
                       what=f"cluster created by the worker; log:\n{events_worker.output()[-3000:]}")
    assert cluster.status == "pending"
    published = [outbox_id for _, _, outbox_id in emitted if outbox_id is not None]
    ((payload, outbox_id),) = [(p, i) for e, p, i in emitted if e == "reservation.confirmed"]
    assert outbox_id in published
    # Each of the booking's events is handled and its row deleted (by the task, before it finishes).
    wait_for(lambda: not OutboxEvent.objects.filter(pk__in=published).exists(), timeout=30,
             what=f"the booking's {len(published)} events dispatched; log:\n{events_worker.output()[-3000:]}")

    # A duplicated message (redelivered after its worker acked late) finds its event already handled;
    # the same event published again (its worker died after the subscribers ran, before deleting
    # the row, so the relay sends it again) runs the subscribers a second time: neither creates
    # anything twice.
    duplicate = tasks.dispatch_event.delay(outbox_id)
    again = OutboxEvent.objects.create(event="reservation.confirmed", payload=payload, created_at=timezone.now(),
                                       available_at=timezone.now() + timedelta(seconds=events.OUTBOX_PUBLISH_LEASE_S))
    rerun = tasks.dispatch_event.delay(again.pk)
    wait_for(lambda: _succeeded(events_worker, duplicate, rerun), timeout=30,
             what=f"both dispatches received and finished; log:\n{events_worker.output()[-3000:]}")
    assert not OutboxEvent.objects.filter(pk=again.pk).exists()  # its subscribers did run
    assert VirtualCluster.objects.filter(reservation=reservation).count() == 1
    assert ClusterTransition.objects.filter(cluster=cluster, phase="pending").count() == 1
