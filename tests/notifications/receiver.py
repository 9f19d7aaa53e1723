"""A real HTTP webhook receiver on loopback, scripted per request, for tests.

It stands in for Slack's incoming-webhook endpoint and for a tenant's webhook server:
requests go through a real socket, so client timeouts, connection reuse and header
handling are exercised for real. Each request takes the next scripted ``Reply`` (or the
default, ``200 ok``) and is recorded, including the ones the client gave up on.

    receiver = WebhookReceiver().start()
    receiver.script(Reply.rate_limited(3), Reply.ok())
    post(receiver.url("/services/T/B/x"), b"{}")   # -> 429, Retry-After: 3
    receiver.wait_for(1)                            # for asynchronous senders (Celery)
    receiver.stop()
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Reply", "Recorded", "WebhookReceiver"]


@dataclasses.dataclass(frozen=True)
class Reply:
    """One scripted answer: status, body, extra headers, a delay before answering, and a pause between bytes."""

    status: int = 200
    body: bytes = b"ok"
    headers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0
    drip_s: float = 0.0

    @classmethod
    def ok(cls) -> Reply:
        return cls(200, b"ok")

    @classmethod
    def rate_limited(cls, retry_after: int | str = 1) -> Reply:
        return cls(429, b"rate_limited", (("Retry-After", str(retry_after)),))

    @classmethod
    def server_error(cls, body: bytes = b"rollup_error") -> Reply:
        return cls(500, body)

    @classmethod
    def slow(cls, delay_s: float) -> Reply:
        """Answer 200 ok, but only after delay_s (set it beyond the client's timeout)."""
        return cls(200, b"ok", delay_s=delay_s)

    @classmethod
    def dripping(cls, drip_s: float, body: bytes = b"ok") -> Reply:
        """Answer 200 with body, but send the whole answer (status line included) one byte every drip_s: each
        read a client makes gets a byte well within any per-read timeout, and the answer still takes ages."""
        return cls(200, body, drip_s=drip_s)

    @classmethod
    def slack_error(cls, status: int, error: str) -> Reply:
        """Answer the way Slack reports a webhook problem: status plus a bare error string."""
        return cls(status, error.encode())

    @classmethod
    def redirect(cls, location: str) -> Reply:
        return cls(302, b"", (("Location", location),))


# Slack's documented answers, ready to script.
INVALID_PAYLOAD = Reply.slack_error(400, "invalid_payload")
ACTION_PROHIBITED = Reply.slack_error(403, "action_prohibited")
CHANNEL_NOT_FOUND = Reply.slack_error(404, "channel_not_found")
CHANNEL_IS_ARCHIVED = Reply.slack_error(410, "channel_is_archived")


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One request as the receiver saw it."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    received_at: float  # time.time()
    reply: Reply

    def json(self) -> Any:
        return json.loads(self.body)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, as Slack and most receivers speak

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._handle()

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    def do_PUT(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        owner = self.server.owner
        reply = owner._next_reply()
        owner._record(
            Recorded(
                method=self.command,
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
                received_at=time.time(),
                reply=reply,
            )
        )
        if reply.delay_s and owner._stopping.wait(reply.delay_s):
            return  # shutting down: drop the answer rather than hold up the test run
        try:
            if reply.drip_s:
                self._drip(reply, owner)
                return
            self.send_response(reply.status)
            for name, value in reply.headers:
                self.send_header(name, value)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and hung up, which is what a slow reply tests

    def _drip(self, reply: Reply, owner: WebhookReceiver) -> None:
        head = [f"HTTP/1.1 {reply.status} Drip", *(f"{name}: {value}" for name, value in reply.headers),
                "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(reply.body)}", "", ""]
        answer = "\r\n".join(head).encode("latin-1") + reply.body
        self.close_connection = True
        for index in range(len(answer)):
            self.wfile.write(answer[index:index + 1])
            self.wfile.flush()
            if owner._stopping.wait(reply.drip_s):
                return

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        pass  # quiet: the recorded requests are the log


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a handler still sleeping on a slow reply must not block stop()
    owner: WebhookReceiver

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-exchange (timed out, or read only part of a huge body)
        # is a scenario under test, not a receiver bug; print anything else as usual.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class WebhookReceiver:
    """Threaded HTTP server on 127.0.0.1 (a free port) that records and answers webhooks."""

    def __init__(self, default: Reply | None = None) -> None:
        self.default = default or Reply.ok()
        self._replies: collections.deque[Reply] = collections.deque()
        self._requests: list[Recorded] = []
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        # A short poll interval: stop() waits up to one interval for the serving loop to notice.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="webhook-receiver", daemon=True
        )

    # lifecycle
    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # addressing
    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str = "/hook") -> str:
        return self.base_url + (path if path.startswith("/") else "/" + path)

    # scripting
    def script(self, *replies: Reply) -> None:
        """Queue replies for the next requests, in order; then the default applies again."""
        with self._cond:
            self._replies.extend(replies)

    def _next_reply(self) -> Reply:
        with self._cond:
            return self._replies.popleft() if self._replies else self.default

    def _record(self, request: Recorded) -> None:
        with self._cond:
            self._requests.append(request)
            self._cond.notify_all()

    # inspection
    @property
    def requests(self) -> list[Recorded]:
        with self._cond:
            return list(self._requests)

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[Recorded]:
        """Block until at least count requests arrived; return them. AssertionError on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._requests) >= count, timeout=timeout_s):
                got = len(self._requests)
                raise AssertionError(f"expected {count} webhook requests within {timeout_s}s, got {got}")
            return list(self._requests)

    def reset(self) -> None:
        with self._cond:
            self._replies.clear()
            self._requests.clear()
