"""The demo webhook receiver started before `make run` wrote var/dev.env (or with its database down).

It reads the default DATABASE_URL then, or one that is not up yet. It must still answer the portal
and print what it got (saying the signature went unchecked), not die in the handler with a traceback
while the portal sees a dropped connection.
"""

from __future__ import annotations

import time

import requests

from notifications import signing

from .conftest import start_receiver_command


def test_receiver_answers_and_prints_when_its_database_is_unreachable(tmp_path):
    # Nothing listens on port 1: as on a fresh clone before `make run` started the embedded PostgreSQL.
    log = tmp_path / "receiver.log"
    proc, port = start_receiver_command(log, DATABASE_URL="postgres://postgres@127.0.0.1:1/portal")
    try:
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
