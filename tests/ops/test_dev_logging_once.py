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
