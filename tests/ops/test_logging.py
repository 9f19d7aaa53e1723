"""Structured JSON logs with request ids: the middleware, the formatter, the Celery hand-over."""

from __future__ import annotations

import io
import json
import logging

import pytest
from celery import signals
from django.test import Client

from portal.ops.logging import JsonFormatter, RequestIdFilter, get_request_id, install_celery_hooks, set_request_id


@pytest.fixture
def captured():
    """JSON lines written through the production formatter by the portal.request and test loggers."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    loggers = [logging.getLogger("portal.request"), logging.getLogger("ops.test")]
    old = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    for lg, (level, propagate) in zip(loggers, old, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.mark.django_db
def test_request_id_is_made_echoed_and_logged(ops, captured):
    response = Client().get("/api/v1/pools/")  # 401: logged at WARNING with the request's id
    request_id = response["X-Request-ID"]
    assert len(request_id) == 32 and int(request_id, 16) >= 0
    (line,) = [e for e in captured() if e["logger"] == "portal.request"]
    assert line["request_id"] == request_id
    assert line["level"] == "WARNING"
    assert (line["http_method"], line["http_path"], line["http_status"]) == ("GET", "/api/v1/pools/", 401)
    assert line["duration_ms"] >= 0 and line["ts"].endswith("Z")
    assert line["message"] == "GET /api/v1/pools/ 401"


@pytest.mark.django_db
@pytest.mark.parametrize(("sent", "kept"), [
    ("edge-7f3a9c2e-41b1", True),
    ("short", False),
    ("has space in it ok", False),
    ("evil\r\nSet-Cookie:x=1", False),
    ("x" * 200, False),
])
def test_a_callers_request_id_is_kept_only_when_it_is_a_safe_token(ops, captured, sent, kept):
    response = Client().get("/no-such-page", HTTP_X_REQUEST_ID=sent)
    assert (response["X-Request-ID"] == sent) is kept
    assert "\n" not in response["X-Request-ID"] and len(response["X-Request-ID"]) <= 128


@pytest.mark.django_db
def test_probes_are_not_access_logged_but_failures_are(ops, captured):
    Client().get("/healthz")
    assert not [e for e in captured() if e["logger"] == "portal.request"]


def test_formatter_writes_extra_fields_and_exceptions(captured):
    log = logging.getLogger("ops.test")
    token = set_request_id("req-1234567890")
    try:
        log.info("booked %s nodes", 3, extra={"reservation_id": 42, "nodes": ["a", "b"]})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        from portal.ops.logging import _request_id

        _request_id.reset(token)
    info, error = captured()
    assert info["message"] == "booked 3 nodes" and info["request_id"] == "req-1234567890"
    assert info["reservation_id"] == 42 and info["nodes"] == ["a", "b"] and info["level"] == "INFO"
    assert error["exc_type"] == "ValueError" and "boom" in error["exc"] and "test_logging.py:" in error["where"]
    assert get_request_id() == ""


def test_request_id_travels_into_celery_tasks():
    install_celery_hooks()
    install_celery_hooks()  # idempotent
    token = set_request_id("req-abcdef123456")
    headers: dict = {}
    try:
        signals.before_task_publish.send(sender="provisioning.provision_cluster", headers=headers, body=None)
    finally:
        from portal.ops.logging import _request_id

        _request_id.reset(token)
    assert headers["request_id"] == "req-abcdef123456"

    class Request:
        id = "task-id-1"
        request_id = headers["request_id"]

    class Task:
        request = Request()

    signals.task_prerun.send(sender=Task, task_id="task-id-1", task=Task())
    assert get_request_id() == "req-abcdef123456"
    signals.task_postrun.send(sender=Task, task_id="task-id-1", task=Task())
    assert get_request_id() == ""
