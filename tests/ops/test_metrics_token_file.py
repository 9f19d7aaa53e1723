"""Production refuses an empty metrics token file, as it refuses a missing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parents[2]


def test_production_refuses_an_empty_metrics_token_file(tmp_path):
    """An empty (or blank) token file read as "no token"; with no allowed network (production's default)
    /metrics then refused everyone, Prometheus too: the only sign was PortalDown, which blames the web
    service. `touch deploy/secrets/metrics_token` is an easy way to get there."""
    token = tmp_path / "metrics_token"
    token.write_text(" \n")
    env = {**os.environ, "SECRET_KEY": "x" * 60, "PORTAL_FERNET_KEYS": Fernet.generate_key().decode(),
           "ALLOWED_HOSTS": "portal.example.com", "DJANGO_SETTINGS_MODULE": "portal.settings.production",
           "PORTAL_METRICS_TOKEN": "", "PORTAL_METRICS_TOKEN_FILE": str(token), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert f"PORTAL_METRICS_TOKEN_FILE={token} is empty" in proc.stderr, proc.stderr[-800:]
    token.write_text("t0ken\n")
    proc = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
