"""Faults with real processes: backend errors, kill -9 of the worker, Redis restarted during a tick."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from portal.core.models import AuditLog
from provisioning import services, tasks
from provisioning.choices import PROVISION_PHASES
from provisioning.constants import LOCK_CLUSTER
from provisioning.models import ClusterTransition, VirtualCluster
from reservations.models import Reservation
from tenants.models import Tenant
from tests.conftest import make_world

from .conftest import book, now_slot, purge_queue, scontrol, start_worker, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]


def status_of(model, pk):
    return model.objects.filter(pk=pk).values_list("status", flat=True).first()


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def phases_of(cluster_id: int) -> list[str]:
    return list(ClusterTransition.objects.filter(cluster_id=cluster_id).order_by("at", "id")
                .values_list("phase", flat=True))


@pytest.fixture
def logs(tmp_path) -> Path:
    purge_queue()
    return tmp_path


def test_backend_errors_retry_with_backoff_fail_visibly_and_staff_retry_succeeds(world, logs):
    worker = start_worker(logs, PORTAL_PROVISIONING_FAULTS="installing_drivers=error:3")
    try:
        start = now_slot(world)
        reservation = book(world, "alpha-member", start, hours=2)
        cluster = VirtualCluster.objects.get(reservation=reservation)
        services.lifecycle_tick()
        wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "failed", timeout=60,
                 what=f"failed; worker log:\n{worker.output()[-3000:]}")

        attempts = list(AuditLog.objects.filter(action="cluster.attempt_failed", object_id=str(cluster.pk))
                        .order_by("id").values_list("after", flat=True))
        assert [a["attempt"] for a in attempts] == [1, 2]
        assert 0.1 <= attempts[0]["retry_in_s"] <= 0.2 and 0.2 <= attempts[1]["retry_in_s"] <= 0.4
        assert worker.output().count("Retry in") >= 2  # Celery retried the task with the countdown

        # Visible to the tenant, with the reason.
        body = world.client("alpha-viewer").get(f"/api/v1/clusters/{cluster.pk}/").json()
        assert body["status"] == "failed" and body["reservation_status"] == "failed"
        assert "installing_drivers: injected transient fault" in body["status_reason"]
        assert body["phases"][-1]["phase"] == "failed"
        assert world.client("alpha-lead").post(f"/api/v1/clusters/{cluster.pk}/retry/").status_code == 403

        response = world.client("staff").post(f"/api/v1/clusters/{cluster.pk}/retry/")
        assert response.status_code == 200, response.json()
        wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "ready", timeout=60,
                 what=f"ready after retry; worker log:\n{worker.output()[-3000:]}")
        wait_for(lambda: status_of(Reservation, reservation.pk) == "active", timeout=10, what="active")
        assert phases_of(cluster.pk)[-8:] == ["failed", "pending", *PROVISION_PHASES, "ready"][-8:]
    finally:
        worker.stop()


def test_kill_9_of_the_worker_mid_provisioning_reaches_ready_once_without_a_second_slurm_reservation(
        world, logs, slurm_backend, prov_slurm, settings):
    env = {"PORTAL_PROVISIONING_BACKEND": "slurm", "PORTAL_SLURM_CONF": str(prov_slurm.slurm_conf)}
    worker = start_worker(logs, PORTAL_PROVISIONING_FAULTS="configuring_network=sleep:120", **env)
    start = now_slot(world)
    reservation = book(world, "alpha-lead", start, hours=3, nodes=2)  # event → Slurm booking via the worker
    name = f"alpha-{reservation.pk}"
    wait_for(lambda: name in slurm_backend.show_reservations(), timeout=30,
             what=f"booking in Slurm; worker log:\n{worker.output()[-3000:]}")
    cluster = VirtualCluster.objects.get(reservation=reservation)
    services.lifecycle_tick()
    wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "configuring_network", timeout=30,
             what=f"configuring_network; worker log:\n{worker.output()[-3000:]}")
    time.sleep(0.3)  # inside the (faulted, slow) phase
    worker.kill(signal.SIGKILL)
    assert worker.proc.returncode == -signal.SIGKILL

    replacement = start_worker(logs, **env)
    # PostgreSQL drops the killed session's advisory lock as soon as it sees the socket close.
    wait_for(lambda: cluster.pk not in services.locked_keys(LOCK_CLUSTER), timeout=10, what="lock released")
    try:
        # The killed task's message waits for Redis's visibility timeout; the tick resends at once
        # because no session holds the cluster's lock any more (PostgreSQL dropped it with the connection).
        settings.PORTAL_PROVISIONING_REDISPATCH_SECONDS = "0"
        assert services.lifecycle_tick().get("redispatched") == 1
        wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "ready", timeout=60,
                 what=f"ready; worker log:\n{replacement.output()[-3000:]}")
        wait_for(lambda: status_of(Reservation, reservation.pk) == "active", timeout=10, what="active")
        services.lifecycle_tick()  # and again: nothing more happens
    finally:
        replacement.stop()

    phases = phases_of(cluster.pk)
    assert phases == ["pending", *PROVISION_PHASES, "ready"]  # the interrupted phase resumed, not re-entered
    assert AuditLog.objects.filter(action="cluster.ready", object_id=str(cluster.pk)).count() == 1
    reservations = slurm_backend.show_reservations()
    assert list(reservations) == [name]
    nodes = sorted(reservation.allocations.filter(active=True).values_list("node__hostname", flat=True))
    assert sorted(reservations[name].nodes) == nodes and reservations[name].accounts == {"alpha"}
    assert scontrol(prov_slurm, "show", "reservation", "--oneliner").count("ReservationName=") == 1


def test_a_killed_pool_process_is_redelivered_by_the_broker(world, logs, settings):
    worker = start_worker(logs, PORTAL_PROVISIONING_FAULTS="configuring_network=sleep:2")
    try:
        reservation = book(world, "beta-lead", now_slot(world), hours=2)
        cluster = VirtualCluster.objects.get(reservation=reservation)
        services.lifecycle_tick()
        wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "configuring_network", timeout=30,
                 what="configuring_network")
        # Kill the pool child running the task (not the main process): acks_late +
        # reject_on_worker_lost put the message back, and a fresh child resumes it. No tick.
        busy = [pid for pid in children_of(worker.proc.pid)]
        assert busy
        for pid in busy:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: status_of(VirtualCluster, cluster.pk) == "ready", timeout=60,
                 what=f"ready; worker log:\n{worker.output()[-3000:]}")
        assert "signal 9 (SIGKILL)" in worker.output()  # the pool saw its child die
        assert phases_of(cluster.pk) == ["pending", *PROVISION_PHASES, "ready"]
    finally:
        worker.stop()


def test_redis_restarted_during_a_tick_loses_no_transition(logs, redis_server):
    """Redis dies (no persistence) while a tick is dispatching; ticks after it recover everything.

    Celery 5.7 / kombu 5.7 may exit the worker's main process on this connection loss
    ("Unrecoverable error: AttributeError … 'hostname'" while restoring unacked messages),
    so the worker runs supervised here, as in production (systemd/compose restart policy).
    """
    from portal.celery import app

    world = make_world(nodes=40, max_nodes=20, burst_nodes=0)
    Tenant.objects.update(storage_quota_tib=40)  # 20 default 1 TiB volumes each
    start = now_slot(world)
    reservations = [book(world, who, start, hours=2) for who in ("alpha-lead", "beta-lead") for _ in range(20)]
    ids = [r.pk for r in reservations]
    worker_env = {"PORTAL_PROVISIONING_REDISPATCH_SECONDS": "2",
                  "PORTAL_PROVISIONING_FAULTS": "allocating_nodes=sleep:0.2"}
    workers = [start_worker(logs, redis_url=redis_server.url, **worker_env)]

    def supervise() -> None:
        if workers[-1].proc.poll() is not None:  # what a supervisor does: start it again
            workers.append(start_worker(logs, redis_url=redis_server.url, **worker_env))

    def send_tick() -> bool:
        try:
            with app.connection_for_write(redis_server.url) as conn:
                tasks.lifecycle_tick.apply_async(connection=conn, retry=False)
            return True
        except Exception:  # noqa: BLE001 - broker still coming back
            return False

    try:
        assert send_tick()
        wait_for(lambda: Reservation.objects.filter(pk__in=ids, status="provisioning").exists(), timeout=30,
                 interval=0.01, what="the tick to start")
        during = Reservation.objects.filter(pk__in=ids, status="provisioning").count()
        redis_server.stop()  # every queued and unacknowledged message is gone with it
        time.sleep(1.5)
        redis_server.start()

        def all_done() -> bool:
            done = Reservation.objects.filter(pk__in=ids, status="active").count() == len(ids)
            if not done:
                supervise()
                send_tick()  # beat keeps ticking every minute; here every ~2 s
                time.sleep(2)
            return done

        wait_for(all_done, timeout=120, interval=0,
                 what="all reservations active (see the worker logs in the test's tmp dir)")
    finally:
        for worker in workers:
            worker.stop()

    print(f"redis restarted with {during}/{len(ids)} reservations moved by the tick; "
          f"worker (re)starts: {len(workers)}")
    assert 0 < during <= len(ids)
    for rid in ids:
        cluster = VirtualCluster.objects.get(reservation_id=rid)
        assert phases_of(cluster.pk) == ["pending", *PROVISION_PHASES, "ready"]
        for action in ("reservation.provisioning", "reservation.active"):
            assert AuditLog.objects.filter(object_type="reservations.reservation", object_id=str(rid),
                                           action=action).count() == 1
    assert "Connection to broker lost" in workers[0].output()
