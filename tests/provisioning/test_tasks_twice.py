"""The teardown and lifecycle tasks run twice at once (real threads, real PostgreSQL): one acts, the other stands
aside, and a late copy changes nothing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection

from provisioning import services, tasks
from provisioning.backends.simulated import SimulatedBackend
from provisioning.choices import ClusterStatus
from provisioning.models import ClusterTransition
from reservations.choices import ReservationStatus
from reservations.services import reservation_cancel

from .test_lifecycle import provisioned

pytestmark = pytest.mark.django_db(transaction=True)


def _at_once(calls):
    """Start calls together in threads of their own; return what each returned (or raised)."""
    start, out = threading.Barrier(len(calls)), {}

    def run(i, call):
        try:
            start.wait(10)
            out[i] = call()
        except Exception as exc:  # noqa: BLE001 - asserted below
            out[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return [out[i] for i in range(len(calls))]


def test_two_teardown_copies_at_once_tear_the_cluster_down_once(world, t0, monkeypatch):
    cluster = provisioned(world, t0)
    reservation_cancel(actor=world.users["alpha-lead"], reservation=cluster.reservation)
    calls, real = [], SimulatedBackend.teardown

    def slow_teardown(self, ctx):
        calls.append(ctx)
        time.sleep(0.5)  # long enough for the other copy to arrive while this one works
        return real(self, ctx)

    monkeypatch.setattr(SimulatedBackend, "teardown", slow_teardown)
    results = _at_once([lambda: services.cluster_teardown(cluster_id=cluster.pk)] * 2)
    assert sorted(results) == sorted([ClusterStatus.DELETED, "busy"]), results
    assert len(calls) == 1
    assert ClusterTransition.objects.filter(cluster=cluster, phase=ClusterStatus.DELETED).count() == 1
    # The busy copy's retry, after the first finished: nothing left to do, the backend is not called.
    assert tasks.teardown_cluster.apply(args=[cluster.pk]).get() == ClusterStatus.DELETED
    assert len(calls) == 1
    cluster.reservation.refresh_from_db()
    assert cluster.reservation.status == ReservationStatus.CANCELLED


def test_two_lifecycle_ticks_at_once_run_one(world, t0, monkeypatch):
    real, ran = services._tick_create_missing, []

    def slow_create_missing():
        ran.append(1)
        time.sleep(0.5)
        return real()

    monkeypatch.setattr(services, "_tick_create_missing", slow_create_missing)
    now = t0 - timedelta(minutes=10)
    results = _at_once([lambda: services.lifecycle_tick(now=now)] * 2)
    assert {"skipped": 1} in results and len(ran) == 1, results
