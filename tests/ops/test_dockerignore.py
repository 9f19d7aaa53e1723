"""What .dockerignore keeps out of the build context, matched the way Docker matches it.

Docker matches each pattern against the whole path from the context's root (Go's filepath.Match, plus
`**` for any number of folders): a bare `__pycache__` only matches a folder at the root, never
`portal/__pycache__`. The Dockerfile copies whole app folders, so a nested pattern must say `**/`.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def to_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    # A matching folder excludes everything below it.
    return re.compile(out + "(?:/.*)?")


def ignored(path: str) -> bool:
    result = False
    for pattern in patterns():
        negate = pattern.startswith("!")
        if to_regex(pattern.lstrip("!")).fullmatch(path):
            result = not negate
    return result


def test_the_matcher_follows_dockers_rules():
    assert to_regex("__pycache__").fullmatch("__pycache__/a.pyc")
    assert not to_regex("__pycache__").fullmatch("portal/__pycache__/a.pyc")
    assert to_regex("**/__pycache__").fullmatch("portal/core/__pycache__/a.pyc")
    assert to_regex("**/__pycache__").fullmatch("__pycache__/a.pyc")


def test_bytecode_and_local_state_stay_out_of_the_image_at_any_depth():
    for path in ("portal/__pycache__/urls.cpython-311.pyc", "reservations/services/__pycache__/x.cpython-311.pyc",
                 "provisioning/health/x.pyc", ".env", ".env.production", "deploy/secrets/metrics_token",
                 "var/dev.env", ".venv/bin/python", ".git/HEAD", "staticfiles/staticfiles.json"):
        assert ignored(path), f"{path} would be sent to the engine and copied into the image"
    for path in ("portal/settings/base.py", "templates/base.html", "static/portal/portal.css", "requirements.lock",
                 "bin/runtime_requirements.py", "gunicorn.conf.py", ".env.example"):
        assert not ignored(path), f"{path} is needed by the build but ignored"
