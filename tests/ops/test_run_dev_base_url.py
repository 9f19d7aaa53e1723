"""`PORTAL_PORT=8791 make run`: links in Slack messages must point at the port the portal listens on.

bin/run_dev.py takes PORTAL_HOST / PORTAL_PORT for runserver, but the workers build the links in
Slack messages from PORTAL_BASE_URL, whose default is http://127.0.0.1:8000 — another port (or
someone else's portal) whenever the demo runs elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]


def _load_run_dev():
    spec = importlib.util.spec_from_file_location("run_dev_under_test", ROOT / "bin" / "run_dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_run_on_another_port_points_links_at_that_port(monkeypatch):
    saved = dict(os.environ)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PORTAL_PORT", "8791")
    monkeypatch.delenv("PORTAL_HOST", raising=False)
    monkeypatch.delenv("PORTAL_BASE_URL", raising=False)
    seen: list[dict] = []

    def popen(argv, *args, **kwargs):
        seen.append(dict(kwargs.get("env") or os.environ))
        proc = mock.Mock()
        proc.poll.return_value = 0
        proc.wait.return_value = 0
        proc.returncode = 0
        return proc

    try:
        run_dev = _load_run_dev()
        with mock.patch.object(subprocess, "run"), mock.patch.object(subprocess, "Popen", side_effect=popen), \
                mock.patch.object(run_dev.signal, "signal"), mock.patch.object(run_dev.time, "sleep"):
            run_dev.main()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert len(seen) == 8  # the four setup steps (services, migrate, seed_demo, collectstatic); web, two workers, beat
    assert {env.get("PORTAL_BASE_URL") for env in seen} == {"http://127.0.0.1:8791"}
