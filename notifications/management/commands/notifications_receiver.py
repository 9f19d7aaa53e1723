"""A local webhook receiver for the demo: print what the portal sends, verify signed webhooks.

    python manage.py notifications_receiver --port 9000
    PORTAL_DEMO_WEBHOOK_URL=http://127.0.0.1:9000/hook make run

It answers ``200 ok`` (what Slack answers, so it also works as PORTAL_PLATFORM_SLACK_WEBHOOK or
a tenant's Slack URL) and, for requests with Standard Webhooks headers, checks the signature
against the secrets of the signed-webhook channels stored in this database (it runs on the
same machine as the demo, so it can read them). ``--reply 500`` or ``--reply 429`` lets you
watch the retries.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, close_old_connections

from notifications import signing
from notifications.choices import ChannelKind
from notifications.models import Channel

# Far more than any message the portal sends (a Slack message is capped well below this).
MAX_BODY_BYTES = 1024 * 1024


def _secrets() -> list[str]:
    close_old_connections()
    found: list[str] = []
    for channel in Channel.objects.filter(kind=ChannelKind.WEBHOOK):
        found += [s for s in (channel.secret, channel.previous_secret) if s]
    return found


class Command(BaseCommand):
    help = "Run a loopback webhook receiver that prints (and verifies) what the portal sends."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=9000)
        parser.add_argument("--reply", type=int, default=200, help="HTTP status to answer (default 200).")
        parser.add_argument("--retry-after", default="1", help="Retry-After seconds sent with --reply 429.")

    def handle(self, *args, host: str, port: int, reply: int, retry_after: str, **options):
        # Refused here with a line saying why, not as a traceback from bind() or a nonsense status line.
        if not 0 <= port <= 65535:
            raise CommandError(f"--port {port}: not a TCP port (0 to 65535).")
        if not 100 <= reply <= 599:
            raise CommandError(f"--reply {reply}: not an HTTP status (100 to 599).")
        out = self.stdout
        style = self.style

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _refuse(self, status: int, reason: bytes) -> None:
                # The body is left unread, so the connection cannot carry another request: close it.
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(reason)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(reason)
                self.close_connection = True

            def do_POST(self):  # noqa: N802 - http.server's naming
                length = (self.headers.get("Content-Length") or "0").strip()
                # 1*DIGIT (RFC 9110), in ASCII: int() would also take "-5", "+2", " 1_0" or other scripts' digits.
                if not (length.isascii() and length.isdigit()):
                    out.write(f"{self.path} refused: Content-Length {length[:40]!r} is not a length\n")
                    self._refuse(400, b"bad_content_length")
                    return
                if int(length) > MAX_BODY_BYTES:
                    out.write(f"{self.path} refused: {length[:40]} bytes is more than this receiver reads\n")
                    self._refuse(413, b"too_large")
                    return
                body = self.rfile.read(int(length))
                headers = {k.lower(): v for k, v in self.headers.items()}
                verdict = ""
                if "webhook-signature" in headers:
                    try:
                        signing.verify(_secrets(), body, headers)
                        verdict = style.SUCCESS(" signature ok")
                    except (signing.SignatureError, ValueError) as exc:
                        verdict = style.ERROR(f" signature BAD ({exc})")
                    except DatabaseError as exc:
                        # Started before `make run` wrote var/dev.env, or the database is down: still
                        # answer and print, say why the signature went unchecked.
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        verdict = style.WARNING(f" signature not checked (no database: {first[:160]})")
                try:
                    data = json.loads(body)
                    summary = data.get("text") or f"{data.get('type')}: {json.dumps(data.get('data'))[:300]}"
                except (ValueError, AttributeError):
                    summary = body[:300].decode("utf-8", "replace")
                out.write(f"{self.path} {headers.get('webhook-id', '')}{verdict}\n  {summary}\n")
                answer = b"ok" if reply < 300 else b"rate_limited" if reply == 429 else b"demo_error"
                self.send_response(reply)
                if reply == 429:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format, *args):  # noqa: A002
                pass

        try:
            server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # the port is taken (an earlier receiver still runs), an unknown host, …
            raise CommandError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.") from None
        out.write(f"Listening on http://{host}:{port}/ (answering {reply}); Ctrl-C stops.\n")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
