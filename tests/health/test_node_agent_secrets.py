"""The GPU node's agent (`python -m provisioning.health.worker node`) starts without the portal's secrets.

It takes checks from its own broker queue and posts reports back on the broker: it signs nothing and decrypts
nothing, so SECRET_KEY and PORTAL_FERNET_KEYS (the portal's, and a node is handed to tenants) are not its to
hold. What it does need is the broker: without one it refuses to start and says so."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import redis
from celery import Celery

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("DJANGO_SETTINGS_MODULE", "SECRET_KEY", "PORTAL_FERNET_KEYS", "CELERY_BROKER_URL", "REDIS_URL",
           "DATABASE_URL")


def node_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in SECRETS}
    env.update({"PYTHONPATH": str(ROOT), **extra})
    return env


def broker_url() -> str:
    return os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def test_the_node_agent_starts_and_runs_checks_without_the_portals_secrets():
    host = f"agent-secrets-{uuid.uuid4().hex[:8]}"
    reports = f"health-{host}"  # the portal's report-back queue, of this test's own name
    faults = json.dumps({"nodes": {host: [{"kind": "ecc_uncorrected", "gpu": 1}]}})
    proc = subprocess.Popen(
        [sys.executable, "-m", "provisioning.health.worker", "node", "--hostname", host, "-l", "info",
         "--without-heartbeat"],
        cwd=ROOT, env=node_env(REDIS_URL=broker_url(), PORTAL_HEALTH_QUEUE=reports, PORTAL_FAKE_NVML=faults),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def wait_for(text: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if proc.poll() is not None and lines.empty():
                return False
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if text in line:
                return True
        return False

    try:
        assert wait_for("ready", 60), "".join(seen)[-3000:]
        # A check sent to the node's queue is run, and its report posted back on the broker.
        job = {"id": 1, "host": host, "level": "quick", "model": "H100-SXM", "gpus": 8, "idle": True, "peers": [],
               "pins": {}, "detail": "compact"}
        Celery(broker=broker_url()).send_task("provisioning.health.agent_run", args=[job], queue=f"node.{host}")
        assert wait_for("succeeded", 30), "".join(seen)[-3000:]
        broker = redis.Redis.from_url(broker_url())
        posted = [json.loads(m)["headers"]["task"] for m in broker.lrange(reports, 0, -1)]
        broker.delete(reports)
        assert "provisioning.health.record_report" in posted, posted
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "SECRET_KEY" not in "".join(seen)


def test_the_node_agent_without_a_broker_says_it_needs_one():
    done = subprocess.run([sys.executable, "-m", "provisioning.health.worker", "node", "--hostname", "gpu-001"],
                          cwd=ROOT, env=node_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "CELERY_BROKER_URL" in done.stderr, done.stderr[-2000:]
    assert "SECRET_KEY must be set" not in done.stderr
