"""`python -m provisioning.health.worker` picks its settings the way every other process of a deployment does."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from provisioning.health import worker

ROOT = Path(__file__).resolve().parents[2]


def test_the_launcher_leaves_an_unset_settings_module_to_the_celery_app(monkeypatch):
    """It set portal.settings.dev when DJANGO_SETTINGS_MODULE was unset, where the Celery app, wsgi and asgi
    default to production: a fleet worker started from an environment file without it ran with DEBUG
    on, dev's fixed secret key and Fernet key, and a developer's var/dev.env."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    launched = []
    monkeypatch.setattr(worker.os, "execv", lambda path, argv: launched.append((path, argv)))
    worker.main(["fleet"])
    assert launched and launched[0][1][1:5] == ["-m", "celery", "-A", "portal"]
    assert "DJANGO_SETTINGS_MODULE" not in os.environ  # the celery app (portal/celery.py) decides: production


def test_the_node_agent_gets_its_own_settings_never_dev_ones(monkeypatch):
    """Unset, a node agent runs portal.settings.node_agent: DEBUG off, no dev keys, no var/dev.env, and none of
    the portal's secrets to hold (tests/health/test_node_agent_secrets.py starts one)."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    launched = []
    monkeypatch.setattr(worker.os, "execv", lambda path, argv: launched.append((path, argv)))
    worker.main(["node", "--hostname", "gpu-001"])
    assert launched and launched[0][1][1:5] == ["-m", "celery", "-A", "portal"]
    assert os.environ["DJANGO_SETTINGS_MODULE"] == "portal.settings.node_agent"


def test_the_node_agent_keeps_a_settings_module_it_is_given(monkeypatch):
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "portal.settings.production")
    monkeypatch.setattr(worker.os, "execv", lambda path, argv: None)
    worker.main(["node", "--hostname", "gpu-001"])
    assert os.environ["DJANGO_SETTINGS_MODULE"] == "portal.settings.production"


def test_the_launcher_keeps_a_settings_module_it_is_given(monkeypatch):
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "portal.settings.dev")
    monkeypatch.setattr(worker.os, "execv", lambda path, argv: None)
    worker.main(["fleet"])
    assert os.environ["DJANGO_SETTINGS_MODULE"] == "portal.settings.dev"


def test_a_worker_launched_without_a_settings_module_runs_production_settings():
    """End to end: the launched Celery worker loads the production settings, which refuse to start without their
    secrets, instead of quietly serving the queue with the dev ones. Nothing listens on the broker URL given, so a
    worker that did start would retry it until the timeout instead of exiting."""
    drop = ("DJANGO_SETTINGS_MODULE", "SECRET_KEY", "PORTAL_FERNET_KEYS", "CELERY_BROKER_URL")
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env.update({"REDIS_URL": "redis://127.0.0.1:9/0", "PORTAL_HEALTH_FLEET_QUEUE": f"fleet-launcher-{uuid.uuid4().hex}",
                "PYTHONPATH": str(ROOT)})
    try:
        done = subprocess.run([sys.executable, "-m", "provisioning.health.worker", "fleet", "-c", "1"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the worker started without production's secrets: {(exc.stderr or b'')[-1500:]!r}")
    assert done.returncode != 0
    assert "SECRET_KEY must be set in production" in done.stderr, done.stderr[-2000:]
