"""An overall wall-clock deadline for one HTTP exchange made with requests.

requests' ``timeout`` bounds each socket operation (the connect, then every read), never the exchange: a
receiver that answers one byte at a time, each within the read timeout, keeps the caller (a Celery worker
delivering a notification) for as long as it likes. ``within(seconds)`` bounds the whole exchange made in
its block: when the time is up a timer shuts down the sockets the exchange uses, which ends the read blocked
on them at once; the caller then sees a requests error, and ``Deadline.cut()`` tells it why.

Only connections of the classes here are watched: ``DeadlineAdapter`` mounted on a session, or a pool whose
connection class takes ``WatchedConnection`` in (``egress.public_session`` does). A deadline belongs to the
thread that opened it. Name resolution (``getaddrinfo``) cannot be interrupted and is not bounded here.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import ProxyManager

__all__ = ["Deadline", "within", "WatchedConnection", "DeadlineAdapter"]

_local = threading.local()


class Deadline:
    """The deadline of one exchange: the sockets it watches, and whether it cut them."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError("deadline must be > 0 seconds")
        self.seconds = float(seconds)
        self._lock = threading.Lock()
        self._connections: list[Any] = []
        self._sockets: list[socket.socket] = []
        self._expired = False
        self._finished = False
        self._timer = threading.Timer(self.seconds, self._expire)
        self._timer.daemon = True

    def watch(self, *, connection: Any = None, sock: socket.socket | None = None) -> None:
        """Cut connection's socket (and sock) when the time is up; at once if it is up already."""
        with self._lock:
            if connection is not None and all(c is not connection for c in self._connections):
                self._connections.append(connection)
            if sock is not None:
                self._sockets.append(sock)
            expired = self._expired
        if expired:
            _shut(getattr(connection, "sock", None))
            _shut(sock)

    def cut(self) -> bool:
        """End the watch; return whether the deadline had cut the exchange (it cannot any more after this)."""
        with self._lock:
            self._finished = True
            return self._expired

    def _expire(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._expired = True
            connections, sockets = list(self._connections), list(self._sockets)
        for connection in connections:
            _shut(getattr(connection, "sock", None))
        for sock in sockets:  # a connection still in its TLS handshake has no .sock yet
            _shut(sock)


def _shut(sock: socket.socket | None) -> None:
    # shutdown (not close) wakes a read blocked on the socket in another thread; the owner closes it as usual.
    # A socket closed or detached meanwhile has no descriptor any more, and refuses (OSError) harmlessly.
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def current() -> Deadline | None:
    return getattr(_local, "deadline", None)


@contextmanager
def within(seconds: float) -> Iterator[Deadline]:
    """Watch the exchange made in the block, in this thread; cut it when seconds have passed."""
    deadline = Deadline(seconds)
    previous = current()
    _local.deadline = deadline
    deadline._timer.start()
    try:
        yield deadline
    finally:
        deadline.cut()
        deadline._timer.cancel()
        _local.deadline = previous


class WatchedConnection:
    """urllib3 connection mixin: puts its socket under the thread's current deadline, if any."""

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()  # type: ignore[misc]
        deadline = current()
        if deadline is not None:
            deadline.watch(sock=sock)  # the TCP socket, before a TLS handshake that could be dripped too
        return sock

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        deadline = current()
        if deadline is not None:
            deadline.watch(connection=self)  # the TLS socket that replaced it; cut now if the time ran out

    def request(self, *args: Any, **kwargs: Any) -> None:
        deadline = current()
        if deadline is not None:
            deadline.watch(connection=self)  # a kept-alive connection, reused without connecting again
        return super().request(*args, **kwargs)  # type: ignore[misc]


class _WatchedHTTPConnection(WatchedConnection, HTTPConnection):
    pass


class _WatchedHTTPSConnection(WatchedConnection, HTTPSConnection):
    pass


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class DeadlineAdapter(HTTPAdapter):
    """A requests adapter whose connections a ``within`` block watches."""

    pool_classes: dict[str, type[HTTPConnectionPool]] = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = dict(self.pool_classes)

    def proxy_manager_for(self, *args: Any, **kwargs: Any) -> Any:  # an HTTP(S) proxy from the environment
        manager = super().proxy_manager_for(*args, **kwargs)
        if type(manager) is ProxyManager:  # (a SOCKS proxy's manager has pool classes of its own: not watched)
            manager.pool_classes_by_scheme = dict(self.pool_classes)
        return manager
