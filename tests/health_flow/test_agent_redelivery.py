"""A check queued behind a long one on a node's agent runs once, not twice.

The agent acknowledges a check when it starts (a redelivered burn-in would run twice), so with
prefetching its worker took the node's next message off ``node.<hostname>`` while the first check still
ran and held it unacknowledged in memory. A medium check may run an hour and a full one four: past the
broker's visibility timeout (3600 s) Redis put the held message back on the queue, and when the long
check finished the agent ran the next check twice (a second burn-in on the node, hours long).

Here a real agent worker (``python -m provisioning.health.worker node``) runs against a private Redis
whose visibility timeout is two seconds, and the first check is made to take several.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from provisioning.health import services
from provisioning.health.choices import CheckTrigger
from tests.chaos.conftest import private_redis  # noqa: F401 - fixture
from tests.provisioning.conftest import ROOT, Worker, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]

HANG_S = 4


def _start_agent(tmp_path, broker_url: str, host: str) -> Worker:
    spec = {"nodes": {host: [{"kind": "hang", "call": "nvmlDeviceGetHandleByIndex", "gpu": 0, "seconds": HANG_S}]}}
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.health_flow.agent_short_visibility_settings",
        "CELERY_BROKER_URL": broker_url,
        "PORTAL_FAKE_NVML": json.dumps(spec),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PORTAL_HEALTH_STATE_DIR", None)
    log = tmp_path / f"agent-{uuid.uuid4().hex[:8]}.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [sys.executable, "-m", "provisioning.health.worker", "node", "--hostname", host, "-l", "info",
             "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )
    worker = Worker(proc, log)
    try:
        wait_for(lambda: " ready." in worker.output() or proc.poll() is not None, timeout=60, what="agent ready")
    except AssertionError:
        worker.kill()
        raise
    assert proc.poll() is None, worker.output()[-4000:]
    return worker


def test_a_check_waiting_behind_a_long_one_runs_once(fleet, settings, tmp_path, private_redis):  # noqa: F811
    settings.PORTAL_HEALTH_AGENT_QUEUE = "node"
    node = fleet.nodes[0]
    agent = _start_agent(tmp_path, private_redis.url, node.hostname)
    try:
        staff = fleet.users["staff"]
        services.health_checks_request(nodes=[node], level="medium", trigger=CheckTrigger.STAFF, actor=staff)
        services.health_checks_request(nodes=[node], level="quick", trigger=CheckTrigger.STAFF, actor=staff)

        def runs() -> list[str]:
            return re.findall(r"Task provisioning\.health\.agent_run\[([0-9a-f-]+)\] succeeded", agent.output())

        wait_for(lambda: len(runs()) >= 2, timeout=90, what="both checks run")
        # A copy put back on the queue would run once the second check finished: give it that long.
        time.sleep(3 * HANG_S)
        done = runs()
        assert len(done) == 2 and len(set(done)) == 2, (
            f"the agent ran {len(done)} checks for 2 messages ({done}):\n{agent.output()[-3000:]}")
    finally:
        agent.kill()
