"""A window change reaches the backend even when Redis restarts after the outbox took the event.

provisioning/handlers.py subscribes on_reservation_changed through the outbox, and the handler now runs
the sync itself (a busy cluster raises, and the outbox runs the event again): it only queued
provisioning.sync_reservation before, and nothing resent a sync lost after the outbox row was deleted.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings

from portal.core import events
from portal.core.models import OutboxEvent
from provisioning import services
from provisioning.backends.simulated import SimulatedBackend
from provisioning.models import VirtualCluster
from reservations.services import reservation_update
from tests.provisioning.conftest import FAST, book, now_slot

from .conftest import start_worker, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]


def test_extension_of_a_live_cluster_reaches_the_backend_after_a_redis_restart(
        world, private_redis, tmp_path, settings):
    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=2)
    services.lifecycle_tick()
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.cluster_provision(cluster_id=cluster.pk)
    cluster.refresh_from_db()
    assert cluster.status == "ready"

    settings.PORTAL_EVENTS_INLINE = False  # production: reservation.changed goes through the outbox
    # The outbox worker (default queue) runs; the provisioning workers are busy or restarting. The
    # simulated fleet's state stays in the suite's Redis (REDIS_URL), the broker is the private one.
    env = {**FAST, "PORTAL_PROVISIONING_BACKEND": "simulated"}
    dispatcher = start_worker(tmp_path, private_redis.url, "default", settings_module="portal.settings.test",
                              cache_redis_url=django_settings.REDIS_URL, **env)
    new_end = start + timedelta(hours=5)
    try:
        reservation_update(actor=world.users["alpha-lead"], reservation=reservation, end=new_end)
        wait_for(lambda: not OutboxEvent.objects.filter(event="reservation.changed").exists(), timeout=30,
                 what=f"reservation.changed dispatched; log:\n{dispatcher.output()[-3000:]}")
        broker = redis.Redis.from_url(private_redis.url)
        assert broker.llen("provisioning") >= 1  # the sync waits in Redis, and only there
        broker.close()
    finally:
        dispatcher.kill()

    private_redis.stop()  # Redis restarts without persistence
    time.sleep(0.5)
    private_redis.start()

    worker = start_worker(tmp_path, private_redis.url, "provisioning,default", settings_module="portal.settings.test",
                          cache_redis_url=django_settings.REDIS_URL, **env)
    try:
        for _ in range(3):  # what beat runs, a few times over
            services.lifecycle_tick()
            events.outbox_relay()
            time.sleep(1)
        backend_end = lambda: SimulatedBackend().status(services.build_context(cluster.pk)).end  # noqa: E731
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and backend_end() != new_end:
            time.sleep(0.3)
        assert backend_end() == new_end, "the backend still holds the old window; only `reconcile` would fix it"
    finally:
        worker.kill()
