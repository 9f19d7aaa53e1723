"""The test database's URL, for the processes a test starts (workers, the app under gunicorn, a CLI)."""

from __future__ import annotations

from urllib.parse import quote

from django.db import connection


def database_url() -> str:
    """postgres:// URL of the database pytest-django created (a Unix-socket directory percent-encoded as the host)."""
    s = connection.settings_dict
    user = quote(s.get("USER") or "", safe="")
    password = quote(s.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else f"{user}@"
    host = quote(s.get("HOST") or "", safe="")
    return f"postgres://{auth}{host}:{s.get('PORT') or 5432}/{s['NAME']}"
