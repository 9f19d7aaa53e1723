"""The booking's background event subscribers run in a real Celery worker, not in the request."""

from __future__ import annotations

import pytest

from portal.core import tasks
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


def test_the_worker_creates_the_cluster_after_the_booking_commits(world, settings, events_worker):
    settings.PORTAL_EVENTS_INLINE = False  # as in production: the request only publishes
    reservation = book(world, "alpha-lead", now_slot(world), hours=2, nodes=2)
    # The booking committed and returned; the cluster is the worker's job.
    cluster = wait_for(lambda: VirtualCluster.objects.filter(reservation=reservation).first(), timeout=60,
                       what=f"cluster created by the worker; log:\n{events_worker.output()[-3000:]}")
    assert cluster.status == "pending"
    assert "core.dispatch_event" in events_worker.output()

    # A duplicated message (redelivery after a worker died) creates nothing twice.
    tasks.dispatch_event.delay("reservation.confirmed", {"reservation_id": reservation.pk,
                                                         "tenant_id": reservation.tenant_id})
    wait_for(lambda: events_worker.output().count("core.dispatch_event") >= 4, timeout=30,
             what="second dispatch received and finished")
    assert VirtualCluster.objects.filter(reservation=reservation).count() == 1
    assert ClusterTransition.objects.filter(cluster=cluster, phase="pending").count() == 1
