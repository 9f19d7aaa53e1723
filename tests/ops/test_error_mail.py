"""Production mails server errors to ADMIN_EMAILS through the SMTP server EMAIL_URL names.

Before EMAIL_URL, nothing in the environment could point Django's mail anywhere: ADMIN_EMAILS was
documented as "mailed on server errors", but every report went to localhost:25 inside the web
container, where nothing listens, and Django's error mail fails silently: no one was ever told.
"""

from __future__ import annotations

import socket
import threading

from .test_production import production_env, run

SEND_AN_ERROR = (
    "import logging, django; django.setup();"
    "logging.getLogger('django.request').error('Internal Server Error: /api/v1/reservations/',"
    " extra={'status_code': 500})"
)


class StubSmtp(threading.Thread):
    """Just enough SMTP to take one message and remember the envelope and the text."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(60)
        self.port = self.listener.getsockname()[1]
        self.commands: list[str] = []
        self.data = b""

    def run(self):
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn, conn.makefile("rb") as lines:
            conn.sendall(b"220 stub ESMTP\r\n")
            for line in lines:
                command = line.decode().strip()
                self.commands.append(command)
                verb = command.split(" ", 1)[0].upper()
                if verb == "DATA":
                    conn.sendall(b"354 go on\r\n")
                    for body in lines:
                        if body == b".\r\n":
                            break
                        self.data += body
                    conn.sendall(b"250 queued\r\n")
                elif verb == "QUIT":
                    conn.sendall(b"221 bye\r\n")
                    return
                else:
                    conn.sendall(b"250 ok\r\n")


def test_a_server_error_is_mailed_to_the_admins_through_email_url():
    smtp = StubSmtp()
    smtp.start()
    try:
        env = production_env(ADMIN_EMAILS="ops@example.com", SERVER_EMAIL="portal@example.com",
                             EMAIL_URL=f"smtp://127.0.0.1:{smtp.port}")
        result = run(["-c", SEND_AN_ERROR], env)
        assert result.returncode == 0, result.stderr
        smtp.join(timeout=30)
    finally:
        smtp.listener.close()
    commands = [c.lower() for c in smtp.commands]
    assert "rcpt to:<ops@example.com>" in commands, smtp.commands
    assert any(c.startswith("mail from:<portal@example.com>") for c in commands), smtp.commands
    assert b"Internal Server Error: /api/v1/reservations/" in smtp.data


def test_email_url_sets_the_smtp_server_and_its_security():
    read = ("import json, django; django.setup(); from django.conf import settings as s;"
            "print(json.dumps([s.EMAIL_HOST, s.EMAIL_PORT, s.EMAIL_HOST_USER, s.EMAIL_HOST_PASSWORD,"
            " s.EMAIL_USE_TLS, s.EMAIL_USE_SSL]))")
    result = run(["-c", read], production_env(EMAIL_URL="smtp+tls://portal%40example.com:s3cr%2Ft@mail.example.com:587"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '["mail.example.com", 587, "portal@example.com", "s3cr/t", true, false]'
    result = run(["-c", read], production_env(EMAIL_URL="smtp+ssl://mail.example.com:465"))
    assert result.stdout.strip() == '["mail.example.com", 465, "", "", false, true]', result.stderr
    # Unset: Django's own default, an SMTP server on this host's port 25.
    result = run(["-c", read], production_env(EMAIL_URL=""))
    assert result.stdout.strip() == '["localhost", 25, "", "", false, false]', result.stderr
    # A scheme Django cannot send with refuses to start, naming the variable.
    result = run(["-c", read], production_env(EMAIL_URL="imap://mail.example.com"))
    assert result.returncode != 0 and "EMAIL_URL" in result.stderr


