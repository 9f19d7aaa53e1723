"""The demo webhook receiver refuses a request whose Content-Length is not a length, and keeps serving.

int("abc") raised in the handler (a traceback, the connection dropped without an answer); a
negative length made it read until the client closed the connection, so a keep-alive client
waited forever. Either is a 400 now, and the next request is answered as usual.
"""

from __future__ import annotations

import socket

import pytest
import requests

from .conftest import start_receiver_command


def _raw(port: int, length: str, body: bytes = b"{}") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /hook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {length}\r\n\r\n".encode() + body)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            pass
        return data


@pytest.mark.parametrize(("length", "status"), [
    ("abc", b"400"), ("-5", b"400"), ("1e3", b"400"), ("+2", b"400"), ("\u0661", b"400"),
    # Far more than any message the portal sends: refused, not waited for.
    ("10000000000", b"413"),
])
def test_a_bad_content_length_is_refused_and_the_receiver_keeps_serving(tmp_path, length, status):
    log = tmp_path / "receiver.log"
    proc, port = start_receiver_command(log, DATABASE_URL="postgres://postgres@127.0.0.1:1/portal")
    try:
        answer = _raw(port, length)
        assert answer.startswith(b"HTTP/1.1 " + status), answer
        ok = requests.post(f"http://127.0.0.1:{port}/hook", json={"text": "still here"}, timeout=10)
        assert ok.status_code == 200 and ok.text == "ok"
        assert "Traceback" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)
