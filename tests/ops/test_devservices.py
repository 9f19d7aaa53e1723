"""bin/devservices.py: a stale Redis pid file (the number reused by another process after a reboot) is
neither trusted nor killed; `up` starts a Redis that answers."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess

import pytest

from portal.settings.base import BASE_DIR


@pytest.fixture
def devservices(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("devservices_under_test", BASE_DIR / "bin" / "devservices.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Every path it touches points into tmp_path: down() must never stop the checkout's own services.
    monkeypatch.setattr(module, "VAR", tmp_path)
    monkeypatch.setattr(module, "ENV_FILE", tmp_path / "dev.env")
    monkeypatch.setattr(module, "PGDATA", tmp_path / "pgdata")
    monkeypatch.setattr(module, "REDIS_DIR", tmp_path / "redis")
    return module


def ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(b"PING\r\n")
        return conn.recv(16)


def test_a_pid_file_naming_another_process_starts_a_real_redis_and_leaves_that_process_alone(devservices):
    stranger = subprocess.Popen(["sleep", "60"])
    started = None
    try:
        devservices.REDIS_DIR.mkdir(parents=True)
        (devservices.REDIS_DIR / "redis.pid").write_text(f"{stranger.pid}\n")
        (devservices.REDIS_DIR / "port").write_text("1")  # nothing listens there
        url = devservices.redis_up()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert ping(port).startswith(b"+PONG")
        started = devservices._redis_pid()
        assert started and started != stranger.pid
        # A second `up` reuses the running one.
        assert devservices.redis_up() == url
        # `down` stops that Redis, never the stranger the old file named.
        (devservices.REDIS_DIR / "redis.pid").write_text(f"{stranger.pid}\n")
        devservices.down()
        assert stranger.poll() is None, "down() killed a process that is not our Redis"
    finally:
        stranger.kill()
        if started:
            try:
                os.kill(started, signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("argv", [["stop"], ["UP"], ["-x"]])
def test_an_unknown_command_prints_the_usage_and_exits_2_without_a_traceback(argv):
    # `python bin/devservices.py stop` (it is `down`) died with a KeyError traceback.
    import sys

    done = subprocess.run([sys.executable, str(BASE_DIR / "bin" / "devservices.py"), *argv],  # noqa: S603
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "usage:" in done.stderr and "up" in done.stderr, done.stderr
    assert done.stdout == ""


def test_help_prints_the_usage_and_starts_nothing():
    import sys

    done = subprocess.run([sys.executable, str(BASE_DIR / "bin" / "devservices.py"), "--help"],  # noqa: S603
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout and "down" in done.stdout, done
