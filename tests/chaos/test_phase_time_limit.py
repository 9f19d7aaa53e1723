"""A provisioning phase (or teardown) that runs past the Celery time limit counts as a failed attempt.

Uncounted (only BackendError was), the tick resent it for ever: the cluster never failed, the tenant was
never told, and the booking sat in `installing_drivers` (or `tearing_down`) until its window ended.
Failures are retried with backoff, counted in the database; after PORTAL_PROVISIONING_MAX_ATTEMPTS the
cluster and its reservation are failed with the reason."""

from __future__ import annotations

import time

import pytest

from provisioning import services
from provisioning.models import VirtualCluster
from tests.provisioning.conftest import book, now_slot, purge_queue, start_worker

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]


def test_a_phase_that_exceeds_the_task_time_limit_fails_after_the_attempts(world, tmp_path, settings, monkeypatch):
    from provisioning import tasks

    # A message carries its publisher's limits (CELERY_TASK_*TIME_LIMIT): the tick here publishes.
    monkeypatch.setattr(tasks.provision_cluster, "time_limit", 8)
    monkeypatch.setattr(tasks.provision_cluster, "soft_time_limit", 2)
    # Celery caches a task's options at its first publish (Task._exec_options): an earlier test that
    # published provision_cluster would otherwise have frozen the limits without them.
    monkeypatch.setattr(tasks.provision_cluster, "_exec_options", None)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    purge_queue()
    worker = start_worker(tmp_path, concurrency=1, CELERY_TASK_TIME_LIMIT="8", CELERY_TASK_SOFT_TIME_LIMIT="2",
                          PORTAL_PROVISIONING_FAULTS="installing_drivers=sleep:60",
                          PORTAL_PROVISIONING_REDISPATCH_SECONDS="1", PORTAL_PROVISIONING_MAX_ATTEMPTS="3")
    settings.PORTAL_PROVISIONING_REDISPATCH_SECONDS = "1"
    try:
        reservation = book(world, "alpha-lead", now_slot(world), hours=2)
        cluster = VirtualCluster.objects.get(reservation=reservation)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            services.lifecycle_tick()  # beat, faster
            cluster.refresh_from_db()
            if cluster.status == "failed":
                break
            time.sleep(1.5)
        assert cluster.status == "failed", (
            f"after 90 s the cluster is still {cluster.status} (attempts={cluster.attempts}, "
            f"time limit hit {worker.output().count('TimeLimitExceeded')} times)")
        assert "time limit" in cluster.last_error
    finally:
        worker.kill()
