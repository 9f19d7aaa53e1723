"""A real Celery worker process runs the checks into the test database.

The worker serves queues of this session's own names on the shared broker (the simulated
fleet's, the report-back queue, and two nodes' own ``node.<hostname>`` queues), with the faults
in its environment, exactly as ``python -m provisioning.health.worker`` would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.db import transaction
from django.db.models import Q

from provisioning.health.choices import OPEN_CHECK_STATUSES
from provisioning.health.models import HealthCheck, Repair
from provisioning.health.services import health_checks_request, health_sweep
from reservations.models import Node, Pool
from tests.dburl import database_url

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
TAG = uuid.uuid4().hex[:8]
FLEET_Q, HEALTH_Q = f"fleet-test-{TAG}", f"health-test-{TAG}"
AGENTS = [f"agent-{TAG}-1", f"agent-{TAG}-2"]
SPEC = {
    "nodes": {
        "sim-003": [{"kind": "ecc_uncorrected", "gpu": 1}],
        "sim-007": [{"kind": "persistence_off", "gpu": 0}],
        AGENTS[1]: [{"kind": "nvlink_down", "gpu": 6, "link": 2}],
    }
}


@pytest.fixture(scope="module")
def worker(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        url = database_url()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings.test",
        "DATABASE_URL": url,
        "PORTAL_FAKE_NVML": json.dumps(SPEC),
        "PORTAL_HEALTH_FLEET_QUEUE": FLEET_Q,
        "PORTAL_HEALTH_QUEUE": HEALTH_Q,
        "PORTAL_HEALTH_FLEET_BATCH": "8",
    }
    queues = ",".join([FLEET_Q, HEALTH_Q, *(f"node.{a}" for a in AGENTS)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queues, "-c", "2", "-l", "warning",
         "-n", f"health-test-{TAG}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    yield proc
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if "Traceback" in (out or ""):
        print(out)  # noqa: T201 - shown with the test's output when something broke


def _wait(ids, timeout=90.0):
    """Wait until the checks are recorded and their consequences applied (a failing one's drain
    commits after its result: reading the node in between saw it still available)."""
    deadline = time.monotonic() + timeout
    pending = HealthCheck.objects.filter(pk__in=ids).filter(
        Q(status__in=OPEN_CHECK_STATUSES) | Q(handled_at__isnull=True))
    while time.monotonic() < deadline:
        if not pending.exists():
            return
        time.sleep(0.25)
    open_ = list(pending.values("pk", "status", "handled_at"))
    raise AssertionError(f"checks still open or unhandled after {timeout} s: {open_[:5]}")


def test_worker_runs_a_fleet_sweep_into_the_database(worker, settings):
    settings.PORTAL_HEALTH_FLEET_QUEUE, settings.PORTAL_HEALTH_QUEUE = FLEET_Q, HEALTH_Q
    settings.PORTAL_HEALTH_FLEET_BATCH = 8
    pool = Pool.objects.create(name="sim", gpu_model="H100-SXM", gpus_per_node=8)
    Node.objects.bulk_create([Node(hostname=f"sim-{i:03d}", pool=pool) for i in range(1, 31)])
    Node.objects.filter(hostname="sim-030").update(state="retired")

    # One transaction, so the checks are sent (on commit) only after the second sweep: in autocommit
    # the worker could finish them first, and a sweep after that rightly queues new ones.
    with transaction.atomic():
        ids = health_sweep()
        assert len(ids) == 29  # every node in service, not the retired one
        assert health_sweep() == []  # the open checks are not doubled
    _wait(ids)

    verdicts = dict(HealthCheck.objects.values_list("node__hostname", "verdict"))
    assert verdicts.pop("sim-003") == "fail" and verdicts.pop("sim-007") == "warn"
    assert set(verdicts.values()) == {"pass"}
    assert {q for q in HealthCheck.objects.values_list("agent_queue", flat=True)} == {FLEET_Q}
    assert not HealthCheck.objects.filter(started_at__isnull=True).exists()
    assert Node.objects.get(hostname="sim-003").state == "draining"
    assert Repair.objects.get().node.hostname == "sim-003"


def test_node_agents_post_reports_back(worker, settings):
    settings.PORTAL_HEALTH_AGENT_QUEUE = "node"
    settings.PORTAL_HEALTH_QUEUE = HEALTH_Q
    pool = Pool.objects.create(name="real", gpu_model="H100-SXM", gpus_per_node=8)
    nodes = [Node.objects.create(hostname=host, pool=pool) for host in AGENTS]
    checks = health_checks_request(nodes=nodes, level="quick", trigger="staff")
    assert [c.agent_queue for c in checks] == [f"node.{a}" for a in AGENTS]
    _wait([c.pk for c in checks])
    by_host = {c.node.hostname: c for c in HealthCheck.objects.select_related("node")}
    assert by_host[AGENTS[0]].verdict == "pass"
    assert by_host[AGENTS[1]].verdict == "fail" and "nvlink_state" in by_host[AGENTS[1]].summary
    # Staff asked: every reading is kept, passing ones too.
    assert any(c["status"] == "pass" for c in by_host[AGENTS[0]].gpu_results[0]["checks"])
    assert Node.objects.get(hostname=AGENTS[1]).state == "draining"
