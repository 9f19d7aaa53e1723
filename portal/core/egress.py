"""Where the portal may POST a tenant's notifications: public addresses only.

A tenant lead types the URL of a webhook or a Slack incoming webhook; the notification worker then
POSTs to it from inside the platform's network and records the answer's status for the lead to
see. Left unchecked that is a probe of the internal network (metadata services, Redis, the
portal itself): server-side request forgery. So a tenant-supplied URL must name a host whose every
address is public (``ipaddress``'s ``is_global``: not loopback, private, link-local, shared,
reserved or multicast; for an IPv6 address that stands for an IPv4 one — IPv4-mapped, NAT64, 6to4,
IPv4-compatible — that IPv4 address, which a translating network delivers to), checked when the URL
is saved and again, after resolving the name, before every POST (a name can be re-pointed after it
was saved).

``PORTAL_WEBHOOK_ALLOW_PRIVATE = True`` lifts the rule for platforms whose chat or webhook
receivers live on their own network (and for the local demo receiver). The platform's own Slack
webhook (``PORTAL_PLATFORM_SLACK_WEBHOOK``) is the operator's and is never checked.

A name that resolves to a public address when checked and to a private one a moment later, when
the HTTP client resolves it again (DNS rebinding with a zero TTL), is caught where it matters: the
session ``public_session()`` gives checks the address each connection actually reached, after
connecting and before a byte is sent, and refuses a private one (``PrivateDestination``).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

import requests
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import NewConnectionError

from .conf import setting_bool
from .deadline import DeadlineAdapter, WatchedConnection

__all__ = ["MAX_URL_LENGTH", "checked_url", "destination_problem", "public_session", "PrivateDestination",
           "private_destination_of"]

MAX_URL_LENGTH = 2000

_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


# IPv6 prefixes whose addresses carry an IPv4 one that a translating network delivers to: NAT64's well-known
# prefix (RFC 6052, the last 32 bits) and its local-use one (RFC 8215, any embedding, so all of it is refused).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d (RFC 4291 2.5.5.1)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for: IPv4-mapped, NAT64, 6to4 or IPv4-compatible; else None."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour  # 2002:a.b.c.d::/48 (RFC 3056), else None


def _private(address: str) -> bool:
    """Whether the portal must not connect to address: not global, multicast, or an IPv6 address standing for
    an IPv4 one that is (Python calls NAT64 and 6to4 addresses global whatever IPv4 address they carry)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("fe80::1%eth0") is link-local anyway
    if ip.is_multicast:
        return True
    if ip.version == 6:
        if ip in _NAT64_LOCAL:
            return True
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return not embedded.is_global or embedded.is_multicast
    return not ip.is_global


def destination_problem(url: str, *, resolve: bool = True) -> str | None:
    """Why a tenant's URL must not be called, in words for the lead; None when it may be."""
    if setting_bool("PORTAL_WEBHOOK_ALLOW_PRIVATE", False):
        return None
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").rstrip(".").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return "not a valid URL"
    if not host:
        return "no host"
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        return f"{host} is this machine"
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return f"{host} is not a public address" if _private(host) else None
    if not resolve:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None  # does not resolve (now): the POST fails as a connection error and is retried
    private = sorted({info[4][0] for info in infos if _private(info[4][0])})
    if private:
        return f"{host} resolves to {', '.join(private)}, not a public address"
    return None


def checked_url(url: Any, *, field: str, hint: str) -> str:
    """url, stripped, if it is an absolute http(s) URL of at most MAX_URL_LENGTH characters, without
    control characters, whose host is a public address; else InvalidInput naming field (hint: what
    to give instead). The one check for every URL a tenant gives the notifier (webhooks, Slack)."""
    from .exceptions import InvalidInput

    url = str(url or "").strip()
    try:
        parts = urlsplit(url)
        # .port raises ValueError for a port that is not a number in 0-65535 (checked here, not only in
        # destination_problem, which PORTAL_WEBHOOK_ALLOW_PRIVATE skips).
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:
        ok = False
    if not ok:
        raise InvalidInput(f"{field}: an absolute http(s) URL is required.", fields={field: hint})
    if len(url) > MAX_URL_LENGTH:
        raise InvalidInput(f"{field}: at most {MAX_URL_LENGTH} characters.", fields={field: "Too long."})
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise InvalidInput(f"{field}: control characters are not allowed.", fields={field: "Remove them."})
    problem = destination_problem(url)
    if problem:
        raise InvalidInput(f"{field}: the portal posts only to public addresses ({problem}).", fields={field: hint})
    return url


# --- the connection itself: the address it reached ----------------------------------------


class PrivateDestination(NewConnectionError):
    """A connection reached a private address (the name was re-pointed after it was checked)."""


class _PublicOnly:
    def _new_conn(self):  # urllib3: opens the TCP connection; HTTPS wraps TLS around it afterwards
        sock = super()._new_conn()
        if setting_bool("PORTAL_WEBHOOK_ALLOW_PRIVATE", False):
            return sock
        try:
            peer = sock.getpeername()[0]
        except OSError:
            peer = ""
        if not peer or _private(peer):
            sock.close()
            raise PrivateDestination(self, f"{self.host} connected to {peer or 'an unknown address'}, "
                                           "not a public address")
        return sock


class _PublicHTTPConnection(_PublicOnly, WatchedConnection, HTTPConnection):
    pass


class _PublicHTTPSConnection(_PublicOnly, WatchedConnection, HTTPSConnection):
    pass


class _PublicHTTPPool(HTTPConnectionPool):
    ConnectionCls = _PublicHTTPConnection


class _PublicHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _PublicHTTPSConnection


class _PublicOnlyAdapter(DeadlineAdapter):  # its connections are watched by a deadline.within block too
    pool_classes = {"http": _PublicHTTPPool, "https": _PublicHTTPSPool}

    def proxy_manager_for(self, *args: Any, **kwargs: Any):  # a proxy's address would be the one checked
        raise requests.exceptions.InvalidURL("tenant destinations are not reached through a proxy")


def public_session() -> requests.Session:
    """A requests session whose every connection must reach a public address (unless
    PORTAL_WEBHOOK_ALLOW_PRIVATE): for tenant-supplied URLs. Environment proxies are not used."""
    session = requests.Session()
    session.trust_env = False
    adapter = _PublicOnlyAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def private_destination_of(exc: BaseException) -> str | None:
    """The refusal message if a requests error came from PrivateDestination, else None."""
    seen: set[int] = set()
    pending: list[Any] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, PrivateDestination):
            return str(current).split(": ", 1)[-1]
        if isinstance(current, BaseException):
            pending.extend([getattr(current, "reason", None), current.__cause__, current.__context__,
                            *[a for a in current.args if isinstance(a, BaseException)]])
    return None
