"""Settings read at call time (never at import): Django settings, else the environment, else a default.

So a Celery worker started with only environment variables behaves like the web process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from django.conf import settings

__all__ = ["setting", "setting_int", "setting_float", "setting_bool"]

_MISSING = object()


def setting(name: str, default: Any = None, cast: Callable[[str], Any] | None = None) -> Any:
    """Return settings.NAME, else $NAME (cast), else default."""
    value = getattr(settings, name, _MISSING)
    if value is not _MISSING:
        return value
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return cast(raw) if cast else raw


def setting_int(name: str, default: int) -> int:
    return int(setting(name, default, int))


def setting_float(name: str, default: float) -> float:
    return float(setting(name, default, float))


# What django-environ's env.bool (the settings modules) counts as true: one reading for every boolean.
TRUE_STRINGS = frozenset({"true", "on", "ok", "y", "yes", "1"})


def setting_bool(name: str, default: bool) -> bool:
    value = setting(name, default, lambda raw: raw.strip().lower() in TRUE_STRINGS)
    return bool(value)
