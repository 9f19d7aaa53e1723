"""The demo webhook receiver started before `make run` wrote var/dev.env (or with its database down).

It reads the default DATABASE_URL then, or one that is not up yet. It must still answer the portal
and print what it got (saying the signature went unchecked), not die in the handler with a traceback
while the portal sees a dropped connection.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from notifications import signing

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_receiver_answers_and_prints_when_its_database_is_unreachable(tmp_path):
    port = _free_port()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings.test", "PYTHONUNBUFFERED": "1",
           # nothing listens on port 1: as on a fresh clone before `make run` started the embedded PostgreSQL
           "DATABASE_URL": "postgres://postgres@127.0.0.1:1/portal"}
    log = tmp_path / "receiver.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [sys.executable, "manage.py", "notifications_receiver", "--port", str(port)], cwd=ROOT, env=env,
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "Listening" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        body = b'{"id":"msg_1","type":"test","timestamp":"2026-01-01T00:00:00Z","data":{}}'
        answer = requests.post(f"http://127.0.0.1:{port}/hook", data=body, timeout=10,
                               headers=signing.sign_headers(signing.generate_secret(), body, msg_id="msg_1"))
        assert answer.status_code == 200 and answer.text == "ok"
        time.sleep(0.5)
        text = log.read_text()
        assert "msg_1" in text, text
        assert "Traceback" not in text, text
    finally:
        proc.terminate()
        proc.wait(10)
