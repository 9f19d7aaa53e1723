"""The demo webhook receiver's bad arguments are one-line CommandErrors, not tracebacks.

A port already taken (a receiver left running from an earlier `make run`), a port out of range,
or a status that is not an HTTP status each died with a Python traceback (OSError, OverflowError)
or served a nonsense status line.
"""

from __future__ import annotations

import io
import socket

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError


def run(*args: str) -> None:
    call_command("notifications_receiver", *args, stdout=io.StringIO(), stderr=io.StringIO())


def test_a_port_in_use_is_a_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"127.0.0.1:{port}"):
            run("--port", str(port))


@pytest.mark.parametrize("args,named", [
    (["--port", "99999"], "--port"),
    (["--port", "-1"], "--port"),
    (["--reply", "42"], "--reply"),
    (["--reply", "1000"], "--reply"),
    (["--host", "no-such-host.invalid"], "no-such-host.invalid"),
])
def test_an_argument_it_cannot_serve_with_is_a_message(args, named):
    with pytest.raises(CommandError, match=named):
        run(*args)
