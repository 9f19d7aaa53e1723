"""Domain events: inline subscribers after commit, background ones through one Celery message per event."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from django.conf import settings as django_settings
from kombu.exceptions import OperationalError

from portal.core import events, tasks

pytestmark = pytest.mark.django_db


@pytest.fixture
def handlers():
    """An inline and two background subscribers of test.happened; each records (name, event, payload)."""
    seen: list[tuple[str, str, dict]] = []

    def make(name):
        def handler(event, payload):
            seen.append((name, event, payload))
        return handler

    subscribed = [("inline", make("inline"), False), ("bg1", make("bg1"), True), ("bg2", make("bg2"), True)]
    for _, handler, background in subscribed:
        events.subscribe("test.happened", handler, background=background)
    yield seen
    for _, handler, _ in subscribed:
        events.unsubscribe("test.happened", handler)


@pytest.fixture
def broker():
    """The test Redis db the Celery broker uses; the default queue is emptied before and after."""
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    client.delete("default")
    yield client
    client.delete("default")


def queued_tasks(client) -> list[tuple[str, list]]:
    out = []
    for raw in client.lrange("default", 0, -1):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], body[0]))
    return out


def test_background_subscribers_cost_the_emitter_one_message(settings, handlers, broker,
                                                             django_capture_on_commit_callbacks):
    settings.PORTAL_EVENTS_INLINE = False
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=7)
    assert handlers == [("inline", "test.happened", {"thing_id": 7})]  # only the inline one ran here
    assert queued_tasks(broker) == [("core.dispatch_event", ["test.happened", {"thing_id": 7}])]

    tasks.dispatch_event("test.happened", {"thing_id": 7})  # what the worker does with the message
    assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]


def test_nothing_is_published_for_an_event_without_background_subscribers(settings, broker,
                                                                          django_capture_on_commit_callbacks):
    settings.PORTAL_EVENTS_INLINE = False
    seen = []

    def record(event, payload):
        seen.append(event)

    events.subscribe("test.quiet", record)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            events.emit("test.quiet")
    finally:
        events.unsubscribe("test.quiet", record)
    assert seen == ["test.quiet"]
    # notifications subscribes to "*" in the background, so a message still goes: exactly one.
    assert [name for name, _ in queued_tasks(broker)] == ["core.dispatch_event"]


def test_a_rolled_back_write_emits_nothing(settings, handlers, broker, django_capture_on_commit_callbacks):
    settings.PORTAL_EVENTS_INLINE = False
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        events.emit("test.happened", thing_id=1)
    assert len(callbacks) == 1  # registered for the commit that never comes
    assert handlers == [] and queued_tasks(broker) == []


def test_broker_down_runs_background_subscribers_inline(settings, handlers, broker, monkeypatch,
                                                         django_capture_on_commit_callbacks):
    settings.PORTAL_EVENTS_INLINE = False

    def refuse(*args, **kwargs):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(tasks.dispatch_event, "apply_async", refuse)
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=3)
    assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]
    assert queued_tasks(broker) == []


def test_a_failing_background_subscriber_does_not_stop_the_others(handlers):
    def broken(event, payload):
        raise RuntimeError("boom")

    events.subscribe("test.happened", broken, background=True)
    try:
        events._background["test.happened"].insert(0, events._background["test.happened"].pop())
        tasks.dispatch_event("test.happened", {"thing_id": 9})
    finally:
        events.unsubscribe("test.happened", broken)
    assert [name for name, _, _ in handlers] == ["bg1", "bg2"]


def test_inline_setting_runs_background_subscribers_after_commit(settings, handlers, broker,
                                                                 django_capture_on_commit_callbacks):
    settings.PORTAL_EVENTS_INLINE = True
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=5)
    assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]
    assert queued_tasks(broker) == []
