"""gunicorn.conf.py's Prometheus multiprocess directory: made when none is given, and removed again."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def load_config() -> dict:
    namespace: dict = {}
    exec(compile((ROOT / "gunicorn.conf.py").read_text(), "gunicorn.conf.py", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_directory_gunicorn_made_is_removed_when_it_exits(monkeypatch, tmp_path):
    """Outside compose nothing sets PROMETHEUS_MULTIPROC_DIR: every start of gunicorn made a fresh
    /tmp/portal-prometheus-* directory (the workers' metric files in it) and none was ever removed."""
    # Set, then deleted: monkeypatch puts back (removes) only what it has seen, and gunicorn.conf.py
    # sets the variable, which must not outlive this test.
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = load_config()
    server = SimpleNamespace(log=SimpleNamespace(exception=lambda *a, **k: None))
    config["on_starting"](server)
    made = Path(config["os"].environ["PROMETHEUS_MULTIPROC_DIR"])
    assert made.parent == tmp_path and made.is_dir()
    (made / "counter_123.db").write_bytes(b"\0" * 16)
    config["on_exit"](server)
    assert not made.exists()


def test_a_directory_the_operator_named_is_left_alone(monkeypatch, tmp_path):
    given = tmp_path / "prom"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    config = load_config()
    server = SimpleNamespace(log=SimpleNamespace(exception=lambda *a, **k: None))
    config["on_starting"](server)
    assert given.is_dir()
    config.get("on_exit", lambda s: None)(server)
    assert given.is_dir()
