"""Structured JSON logs with a request id that follows a request into its Celery tasks.

* ``RequestIdMiddleware`` takes the caller's ``X-Request-ID`` (when it is a sane token) or makes
  one, keeps it in a context variable for every log line of the request, returns it in the
  response header, and writes one access-log line per request (logger ``portal.request``).
* ``JsonFormatter`` writes one JSON object per line: ``ts, level, logger, message,
  request_id`` plus any ``extra=`` fields and the exception text.
* ``install_celery_hooks`` sends the request id along as a task header and restores it in the
  worker, so the logs of a booking and of the provisioning it started share one id.

LOGGING example (production.py uses it)::

    "formatters": {"json": {"()": "portal.ops.logging.JsonFormatter"}},
    "filters": {"request_id": {"()": "portal.ops.logging.RequestIdFilter"}},
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import traceback
import uuid
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "JsonFormatter",
    "RequestIdFilter",
    "RequestIdMiddleware",
    "get_request_id",
    "install_celery_hooks",
    "REQUEST_ID_HEADER",
]

REQUEST_ID_HEADER = "X-Request-ID"
# Accept a caller's id only if it cannot smuggle anything into logs or headers.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{8,128}$")
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("portal_request_id", default="")

# Attributes every LogRecord has; anything else on a record came from extra= and is logged as a field.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

access_logger = logging.getLogger("portal.request")


def get_request_id() -> str:
    return _request_id.get()


def set_request_id(value: str) -> contextvars.Token:
    return _request_id.set(value)


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Put the current request id on every record (for plain-text formats: %(request_id)s)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = _request_id.get()
        return True


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


# URL parameters that are secrets (the calendar feed's token): logged as "…", never in full.
SECRET_URL_KWARGS = ("token",)
# The same secret in an address that resolves to no view (a feed address with its ".ics" dropped or a slash
# added, answered 404; "//ical/…" from a client that joins its base address and the path): the segment after
# /ical/<slug>/ is blanked whatever matched.
_SECRET_PATH = re.compile(r"^(/+ical/[^/]+/)[^/]+?(\.ics)?(?=/|$)")


def loggable_path(request) -> str:
    """request.path with any secret URL parameter blanked out (no query string)."""
    path = request.path
    match = getattr(request, "resolver_match", None)
    kwargs = match.kwargs if match is not None else {}
    for name in SECRET_URL_KWARGS:
        value = kwargs.get(name)
        if value:
            path = path.replace(str(value), "…")
    return _SECRET_PATH.sub(r"\1…\2", path)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; timestamps in UTC with milliseconds."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        request = getattr(record, "request", None)
        if request is not None and hasattr(request, "path"):
            # django.request's lines name the request and its path: both without secrets or the query.
            safe = loggable_path(request)
            message = message.replace(request.path, safe)
            record = logging.makeLogRecord({**vars(record), "request": f"{request.method} {safe}"})
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
            "request_id": getattr(record, "request_id", None) or _request_id.get() or None,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in entry and not key.startswith("_"):
                entry[key] = _jsonable(value)
        if record.exc_info:
            entry["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            entry["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = record.stack_info
        if record.levelno >= logging.ERROR or record.levelno <= logging.DEBUG:
            entry["where"] = f"{record.pathname}:{record.lineno}"
        return json.dumps(entry, ensure_ascii=False, default=str)


class RequestIdMiddleware:
    """Give every request an id, log it on each line, echo it back, and write an access-log line."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        incoming = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = incoming if _VALID_ID.match(incoming) else new_request_id()
        request.request_id = request_id
        token = _request_id.set(request_id)
        started = time.perf_counter()
        try:
            response = self.get_response(request)
            response[REQUEST_ID_HEADER] = request_id
            self._access_log(request, response.status_code, time.perf_counter() - started)
            return response
        finally:
            _request_id.reset(token)

    @staticmethod
    def _access_log(request, status: int, seconds: float) -> None:
        match = getattr(request, "resolver_match", None)
        if match is not None and match.view_name in ("ops-healthz", "ops-readyz", "ops-metrics") and status < 400:
            return  # probes and scrapes every few seconds would drown the log
        user = getattr(request, "user", None)
        level = logging.ERROR if status >= 500 else logging.WARNING if status >= 400 else logging.INFO
        path = loggable_path(request)
        access_logger.log(
            level,
            "%s %s %s",
            request.method,
            path,
            status,
            extra={
                "http_method": request.method,
                "http_path": path,
                "http_status": status,
                "duration_ms": round(seconds * 1000, 2),
                "view": match.view_name if match is not None else None,
                "user_id": getattr(user, "pk", None) if getattr(user, "is_authenticated", False) else None,
                "remote_addr": request.META.get("REMOTE_ADDR"),
            },
        )


_hooks_installed = False


def install_celery_hooks() -> None:
    """Carry the request id from the publishing request into the task's log lines (idempotent)."""
    global _hooks_installed
    if _hooks_installed:
        return
    from celery import signals

    def add_header(headers=None, **kwargs):
        request_id = _request_id.get()
        if headers is not None and request_id and "request_id" not in headers:
            headers["request_id"] = request_id

    def restore(task=None, **kwargs):
        request = getattr(task, "request", None)
        request_id = getattr(request, "request_id", None) if request is not None else None
        if request_id is None and request is not None:
            request_id = (getattr(request, "headers", None) or {}).get("request_id")
        _request_id.set(request_id or f"task-{getattr(request, 'id', '') or new_request_id()}")

    def clear(**kwargs):
        _request_id.set("")

    signals.before_task_publish.connect(add_header, weak=False)
    signals.task_prerun.connect(restore, weak=False)
    signals.task_postrun.connect(clear, weak=False)
    _hooks_installed = True
