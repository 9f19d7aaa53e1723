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


def _check(token_file: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SECRET_KEY": "x" * 60, "PORTAL_FERNET_KEYS": Fernet.generate_key().decode(),
           "ALLOWED_HOSTS": "portal.example.com", "DJANGO_SETTINGS_MODULE": "portal.settings.production",
           "PORTAL_METRICS_TOKEN": "", "PORTAL_METRICS_TOKEN_FILE": str(token_file), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_production_refuses_an_unreadable_metrics_token_file_with_a_clear_message(tmp_path):
    """A token file that exists but cannot be read (a secret mounted 0600 for another user, or a directory
    where the file should be) crashed start-up with a bare PermissionError/IsADirectoryError traceback;
    it now gets the same ImproperlyConfigured message as a missing file, naming the file and the cause."""
    directory = tmp_path / "metrics_token_dir"
    directory.mkdir()  # open() on a directory fails even for root
    unreadable = [(directory, "IsADirectoryError: Is a directory")]
    if os.geteuid() != 0:  # root reads a mode-000 file regardless
        no_access = tmp_path / "metrics_token_0000"
        no_access.write_text("t0ken\n")
        no_access.chmod(0)
        unreadable.append((no_access, "PermissionError: Permission denied"))
    for path, cause in unreadable:
        proc = _check(path)
        assert proc.returncode != 0
        assert "ImproperlyConfigured" in proc.stderr, proc.stderr[-800:]
        assert f"PORTAL_METRICS_TOKEN_FILE={path} cannot be read ({cause})" in proc.stderr, proc.stderr[-800:]


def test_production_refuses_a_metrics_token_file_that_is_not_utf8_with_a_clear_message(tmp_path):
    """A token file holding bytes that are not UTF-8 (a binary blob copied in by mistake, a token saved in
    UTF-16 by an editor) crashed start-up with a bare UnicodeDecodeError traceback that did not name the
    file; it now gets an ImproperlyConfigured message like the other unreadable cases."""
    token = tmp_path / "metrics_token_utf16"
    token.write_bytes("t0ken\n".encode("utf-16"))  # starts with the BOM 0xff 0xfe: never valid UTF-8
    proc = _check(token)
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr, proc.stderr[-800:]
    assert "UnicodeDecodeError" not in proc.stderr, proc.stderr[-800:]
    assert f"PORTAL_METRICS_TOKEN_FILE={token} cannot be read (not UTF-8 text" in proc.stderr, proc.stderr[-800:]
