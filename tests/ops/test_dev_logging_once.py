"""`make run`'s output: every django.* warning (each 403 or 404 with its traceback) is printed twice.

Django's own DEFAULT_LOGGING gives the `django` logger a console handler (DEBUG only) and lets it
propagate; the portal's LOGGING adds a root console handler and leaves the `django` logger alone, so
in development every record of django.request / django.security / ... comes out twice, once
without the request id.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, django
django.setup()
logging.getLogger("django.request").warning("once-marker %s", "x")
logging.getLogger("django.security.csrf").warning("once-marker %s", "y")
"""


def test_a_django_warning_is_logged_once_under_make_run_settings():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings.dev"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: S603
                          timeout=60, check=True)
    out = done.stdout + done.stderr
    assert out.count("once-marker x") == 1, out
    assert out.count("once-marker y") == 1, out


LEAK_SCRIPT = """
import threading, django, requests
from http.server import BaseHTTPRequestHandler, HTTPServer
django.setup()

class Ok(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass

server = HTTPServer(("127.0.0.1", 0), Ok)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_port}/services/T000/B000/hush-secret-token"
assert requests.post(url, json={"text": "hi"}, timeout=10).status_code == 200
import logging
logging.getLogger("portal.test").debug("debug-is-on")
"""


def test_debug_logging_does_not_print_a_webhook_urls_secret_path():
    """Slack incoming-webhook URLs carry their secret in the path; urllib3 logs request paths at DEBUG."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings.dev", "LOG_LEVEL": "DEBUG"}
    done = subprocess.run([sys.executable, "-c", LEAK_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: S603
                          timeout=60, check=True)
    out = done.stdout + done.stderr
    assert "debug-is-on" in out, out  # DEBUG records do come out
    assert "hush-secret-token" not in out, out
