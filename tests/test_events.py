"""Domain events: inline subscribers after commit; background ones through the outbox and one Celery message."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone
from kombu.exceptions import OperationalError

from portal.core import events, tasks
from portal.core.models import OutboxEvent

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


@pytest.fixture
def outboxed(settings):
    settings.PORTAL_EVENTS_INLINE = False  # as in production


def queued_tasks(client) -> list[tuple[str, list]]:
    out = []
    for raw in client.lrange("default", 0, -1):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], body[0]))
    return out


def refuse(*args, **kwargs):
    raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def relay_queued(client) -> bool:
    return bool(client.exists(events._relay_queued_key()))


def test_background_subscribers_cost_the_emitter_one_row_and_a_relay_wake_up(outboxed, handlers, broker,
                                                                            django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=7, at=timezone.now())
    assert [name for name, _, _ in handlers] == ["inline"]  # only the inline one ran here
    row = OutboxEvent.objects.get()
    assert row.event == "test.happened" and row.payload["thing_id"] == 7 and row.attempts == 0
    assert row.available_at <= timezone.now()  # due at once: the relay's to publish
    assert queued_tasks(broker) == [("core.outbox_relay", [])]  # no task message of the event built here
    assert relay_queued(broker)

    broker.delete("default")
    assert tasks.outbox_relay() == 1  # what a worker does with the wake-up
    assert not relay_queued(broker)  # cleared as the run started
    assert queued_tasks(broker) == [("core.dispatch_event", [row.pk])]
    row.refresh_from_db()  # leased: the relay's beat run does not send it again meanwhile
    assert row.available_at > timezone.now() + timedelta(seconds=events.OUTBOX_PUBLISH_LEASE_S - 10)

    assert tasks.dispatch_event(row.pk) == "done"  # what the worker does with the message
    assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]
    assert handlers[1][2]["thing_id"] == 7 and isinstance(handlers[1][2]["at"], str)  # JSON, as a worker gets it
    assert not OutboxEvent.objects.exists()

    assert tasks.dispatch_event(row.pk) == "duplicate"  # the event is done, nothing runs twice
    assert len(handlers) == 3


def test_a_burst_of_commits_queues_one_relay_run_and_a_commit_after_it_started_the_next(
        outboxed, handlers, broker, django_capture_on_commit_callbacks):
    for i in range(20):
        with django_capture_on_commit_callbacks(execute=True):
            events.emit("test.happened", thing_id=i)
    assert queued_tasks(broker) == [("core.outbox_relay", [])]  # one wake-up for the 20 commits
    broker.delete("default")
    assert tasks.outbox_relay() == 20  # the queued run finds every row committed before it looked
    # The run cleared the flag before it looked: a commit after that (its row possibly after the run's
    # scan) queues the next run instead of waiting for the beat.
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=99)
    names = [name for name, _ in queued_tasks(broker)]
    assert names.count("core.dispatch_event") == 20 and names.count("core.outbox_relay") == 1


@pytest.mark.django_db(transaction=True)
def test_commits_racing_relay_runs_leave_no_event_behind(outboxed, handlers, broker):
    """Emitters commit while two workers run the relay off the queue's wake-ups: when the emitters are done
    and the queue is drained, every event has been published exactly once and none is left waiting for the
    beat (a commit landing between a run's clearing the flag and its scan, or after the scan, queued a run)."""
    emitters, per_emitter = 4, 15
    barrier = threading.Barrier(emitters + 2)
    done = threading.Event()
    published: list[int] = []
    errors: list[BaseException] = []

    def emit_many(k):
        try:
            barrier.wait(10)
            for i in range(per_emitter):
                events.emit("test.happened", thing_id=k * 100 + i)  # autocommit: committed, then the wake-up
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    def worker():
        try:
            barrier.wait(10)
            while True:
                raw = broker.rpop("default")  # kombu's Redis transport pushes left, consumes right
                if raw is None:
                    if done.is_set():
                        return
                    time.sleep(0.002)
                    continue
                if json.loads(raw)["headers"]["task"] == "core.outbox_relay":
                    published.extend(events.outbox_relay())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=emit_many, args=(k,)) for k in range(emitters)]
    workers = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads + workers:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    for t in workers:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads + workers)
    rows = list(OutboxEvent.objects.values_list("id", flat=True))
    assert len(rows) == emitters * per_emitter
    assert sorted(published) == sorted(rows)  # each one published, once
    assert not OutboxEvent.objects.filter(available_at__lte=timezone.now()).exists()  # none left for the beat


def test_an_event_without_background_subscribers_of_its_own_still_reaches_notifications(outboxed, broker,
                                                                          django_capture_on_commit_callbacks):
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
    # notifications subscribes to "*" in the background, so the relay is still woken: exactly once.
    assert [name for name, _ in queued_tasks(broker)] == ["core.outbox_relay"]
    assert OutboxEvent.objects.count() == 1


def test_a_rolled_back_write_leaves_no_event(outboxed, handlers, broker, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            events.emit("test.happened", thing_id=1)
            assert OutboxEvent.objects.count() == 1  # written with the change...
            raise RuntimeError("the change fails")
    assert callbacks == []  # ...and gone with it
    assert not OutboxEvent.objects.exists()
    assert handlers == [] and queued_tasks(broker) == []


def test_broker_down_keeps_the_event_for_the_relay(outboxed, handlers, broker, monkeypatch,
                                                   django_capture_on_commit_callbacks, caplog):
    monkeypatch.setattr(tasks.dispatch_event, "apply_async", refuse)
    monkeypatch.setattr(tasks.outbox_relay, "apply_async", refuse)
    with django_capture_on_commit_callbacks(execute=True), caplog.at_level(logging.WARNING):
        events.emit("test.happened", thing_id=3)
    # The emitter did not run the background work itself and lost nothing: the row is due now.
    assert [name for name, _, _ in handlers] == ["inline"]
    row = OutboxEvent.objects.get()
    assert row.available_at <= timezone.now()
    assert "its beat run will publish" in caplog.text
    assert not relay_queued(broker)  # no run was queued: the next commit tries again at once

    assert events.outbox_relay() == []  # still down: the relay keeps it due
    assert OutboxEvent.objects.get().available_at <= timezone.now()

    monkeypatch.undo()  # the broker is back
    assert events.outbox_relay() == [row.pk]
    assert queued_tasks(broker) == [("core.dispatch_event", [row.pk])]
    tasks.dispatch_event(row.pk)
    assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]
    assert not OutboxEvent.objects.exists()


def test_a_wake_up_publishes_more_due_events_than_one_batch(outboxed, handlers, broker,
                                                         django_capture_on_commit_callbacks):
    """A transaction (or a burst of commits while one relay run is queued) leaves more events than a batch: the
    woken run publishes them all, not one batch and the rest to the beat's runs (a batch every 15 s)."""
    with django_capture_on_commit_callbacks(execute=True):
        for i in range(12):
            events.emit("test.happened", thing_id=i)
    assert queued_tasks(broker) == [("core.outbox_relay", [])]  # one wake-up for the transaction
    broker.delete("default")
    rows = sorted(OutboxEvent.objects.values_list("id", flat=True))
    assert events.outbox_relay(limit=5) == rows  # three batches: 5, 5, 2
    assert [body[0] for _, body in queued_tasks(broker)] == rows[::-1]  # kombu pushes left
    assert not OutboxEvent.objects.filter(available_at__lte=timezone.now()).exists()  # none left for the beat


def test_a_relay_run_stops_at_a_batch_the_broker_refused(outboxed, handlers, broker, monkeypatch,
                                                         django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        for i in range(12):
            events.emit("test.happened", thing_id=i)
    monkeypatch.setattr(tasks.dispatch_event, "apply_async", refuse)
    assert events.outbox_relay(limit=5) == []  # one batch tried, handed back due; no loop over the same rows
    assert OutboxEvent.objects.filter(available_at__lte=timezone.now()).count() == 12


def test_the_relays_scan_reads_the_due_events_not_the_leased_backlog(outboxed, handlers, broker):
    """Every commit wakes a relay run now, so its scan must not walk the events already sent and waiting for a
    worker (a backlog of 50k leased rows: 23 ms of PostgreSQL per run walking the primary key, for 3 due)."""
    with connection.cursor() as cur:
        cur.execute("INSERT INTO core_outboxevent (event, payload, created_at, available_at, attempts)"
                    " SELECT 'test.happened', '{}', now(), now() + interval '120 s', 0 FROM generate_series(1, 5000)")
        cur.execute("INSERT INTO core_outboxevent (event, payload, created_at, available_at, attempts)"
                    " SELECT 'test.happened', '{}', now(), now() - interval '1 s', 0 FROM generate_series(1, 3)")
        cur.execute("ANALYZE core_outboxevent")
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + events._OUTBOX_DUE,
                    [events.OUTBOX_PUBLISH_LEASE_S, events.OUTBOX_MAX_ATTEMPTS, 500])
        plan = cur.fetchone()[0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    read = []

    def walk(node):
        if node.get("Relation Name") == "core_outboxevent":
            read.append(node["Actual Rows"] * node["Actual Loops"] + node.get("Rows Removed by Filter", 0))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    assert sum(read) <= 20, (read, json.dumps(plan, indent=1))  # the 3 due ones (and their update), not 5,003


def test_the_relay_repeats_only_events_whose_lease_passed(outboxed, handlers, broker,
                                                          django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=1)
        events.emit("test.happened", thing_id=2)
    first, second = OutboxEvent.objects.order_by("id")
    broker.delete("default")
    assert events.outbox_relay() == [first.pk, second.pk]  # the wake-up's run: due at once
    broker.delete("default")
    assert events.outbox_relay() == []  # both messages left a moment ago

    # The first one's message was lost (say the broker restarted without persistence).
    OutboxEvent.objects.filter(pk=first.pk).update(available_at=timezone.now() - timedelta(seconds=1))
    assert events.outbox_relay() == [first.pk]
    assert queued_tasks(broker) == [("core.dispatch_event", [first.pk])]
    assert events.outbox_relay() == []  # published again once per lease, not on every beat

    # A claim by a worker that then died counts an attempt; ten of them and it is left alone.
    OutboxEvent.objects.filter(pk=second.pk).update(attempts=events.OUTBOX_MAX_ATTEMPTS,
                                                   available_at=timezone.now() - timedelta(seconds=1))
    assert events.outbox_relay() == []


def test_a_failing_background_subscriber_is_retried_without_stopping_the_others(
        outboxed, handlers, broker, django_capture_on_commit_callbacks, caplog):
    calls = []

    def flaky(event, payload):
        calls.append(event)
        if len(calls) == 1:
            raise RuntimeError("database blip")

    events.subscribe("test.happened", flaky, background=True)
    try:
        events._background["test.happened"].insert(0, events._background["test.happened"].pop())
        with django_capture_on_commit_callbacks(execute=True):
            events.emit("test.happened", thing_id=9)
        row = OutboxEvent.objects.get()
        with caplog.at_level(logging.WARNING):
            assert tasks.dispatch_event(row.pk) == "retry"
        assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]  # the others ran
        row.refresh_from_db()  # kept for another go after a backoff, not lost and not hammered
        assert row.attempts == 1
        assert timezone.now() + timedelta(seconds=events.OUTBOX_RETRY_STEP_S - 10) < row.available_at
        assert "a subscriber failed" in caplog.text

        OutboxEvent.objects.filter(pk=row.pk).update(available_at=timezone.now() - timedelta(seconds=1))
        assert events.outbox_relay() == [row.pk]
        assert tasks.dispatch_event(row.pk) == "done"
    finally:
        events.unsubscribe("test.happened", flaky)
    assert calls == ["test.happened", "test.happened"]
    assert not OutboxEvent.objects.exists()


def test_a_poison_event_stops_after_the_last_attempt(outboxed, handlers, broker,
                                                     django_capture_on_commit_callbacks, caplog):
    """A subscriber that kills its worker: late acks redeliver the message at once, each time."""
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=13)
    row = OutboxEvent.objects.get()
    OutboxEvent.objects.filter(pk=row.pk).update(attempts=events.OUTBOX_MAX_ATTEMPTS)
    with caplog.at_level(logging.ERROR):
        assert tasks.dispatch_event(row.pk) == "stuck"
    assert [name for name, _, _ in handlers] == ["inline"]  # no background subscriber ran
    assert OutboxEvent.objects.get().attempts == events.OUTBOX_MAX_ATTEMPTS  # kept, for an operator
    assert "left for an operator" in caplog.text


def test_stuck_events_are_reported_at_the_beats_pace_not_per_wake_up(outboxed, handlers, broker, monkeypatch,
                                                                      django_capture_on_commit_callbacks, caplog):
    """Every commit now wakes a relay run: one stuck event must not turn each of them into an ERROR line (and a
    count over the whole table); a worker reports it as often as the beat runs the relay."""
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=14)
    OutboxEvent.objects.update(attempts=events.OUTBOX_MAX_ATTEMPTS)
    clock = [1000.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(events, "_stuck_reported_at", None)

    def reports():
        return sum("left for an operator" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)

    with caplog.at_level(logging.ERROR):
        for _ in range(20):  # twenty bookings' wake-ups within a second
            events.outbox_relay()
        assert reports() == 1
        clock[0] += events.OUTBOX_STUCK_REPORT_S
        events.outbox_relay()
        assert reports() == 2  # still said, at the beat's pace


def test_a_claimed_event_is_held_for_the_task_time_limit(outboxed, handlers, broker, settings,
                                                         django_capture_on_commit_callbacks):
    """While its worker is still within the task time limit, the relay does not send it to another."""
    settings.CELERY_TASK_TIME_LIMIT = 600
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=21)
    row = OutboxEvent.objects.get()
    held = []

    def slow(event, payload):  # observe the row while the subscribers run
        held.append(OutboxEvent.objects.get(pk=row.pk).available_at)

    events.subscribe("test.happened", slow, background=True)
    try:
        assert tasks.dispatch_event(row.pk) == "done"
    finally:
        events.unsubscribe("test.happened", slow)
    assert held[0] > timezone.now() + timedelta(seconds=600)


def test_a_message_from_before_the_outbox_is_still_handled(handlers):
    """A rolling deploy: messages queued by the old release carry (event, payload), not an id."""
    assert tasks.dispatch_event("test.happened", {"thing_id": 4}) == "legacy"
    assert [name for name, _, _ in handlers] == ["bg1", "bg2"]
    assert handlers[0][2] == {"thing_id": 4}


def test_inline_setting_runs_background_subscribers_after_commit(settings, handlers, broker,
                                                                 django_capture_on_commit_callbacks):
    settings.PORTAL_EVENTS_INLINE = True
    when = timezone.now()
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=5, at=when)
        settings.PORTAL_EVENTS_INLINE = False  # flipped before the commit: what emit decided holds
    assert [name for name, _, _ in handlers] == ["inline", "bg1", "bg2"]
    assert handlers[0][2]["at"] == when  # inline subscribers get the payload as emitted
    assert isinstance(handlers[1][2]["at"], str)  # background ones get JSON, as a worker would
    assert queued_tasks(broker) == [] and not OutboxEvent.objects.exists()


def test_the_outbox_is_on_metrics(outboxed, handlers, monkeypatch, django_capture_on_commit_callbacks):
    monkeypatch.setattr(tasks.dispatch_event, "apply_async", refuse)
    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=1)
        events.emit("test.happened", thing_id=2)
    OutboxEvent.objects.filter(pk=OutboxEvent.objects.order_by("id").first().pk).update(
        attempts=events.OUTBOX_MAX_ATTEMPTS, created_at=timezone.now() - timedelta(minutes=5))
    body = Client().get("/metrics").content.decode()
    assert 'portal_metrics_source_up{source="events"} 1.0' in body
    assert 'portal_outbox_events{state="pending"} 1.0' in body
    assert 'portal_outbox_events{state="stuck"} 1.0' in body
    age = float(next(line.split()[-1] for line in body.splitlines()
                     if line.startswith("portal_outbox_oldest_age_seconds ")))
    assert 0 <= age < 60  # the stuck one (5 minutes old) does not pin the backlog age


@pytest.mark.django_db(transaction=True)
def test_racing_relays_publish_each_due_event_once(outboxed, handlers, broker, monkeypatch):
    """Two beat processes by mistake (or a slow relay overlapping the next): no event goes twice."""
    monkeypatch.setattr(tasks.dispatch_event, "apply_async", refuse)
    for i in range(60):
        events.emit("test.happened", thing_id=i)  # autocommit: each commits at once; publishing fails
    monkeypatch.undo()
    assert OutboxEvent.objects.filter(available_at__lte=timezone.now()).count() == 60

    relays, barrier, sent, errors = 6, threading.Barrier(6), [], []

    def relay():
        try:
            barrier.wait(10)
            sent.extend(events.outbox_relay(limit=25))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=relay) for _ in range(relays)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(sent) == sorted(OutboxEvent.objects.values_list("id", flat=True))  # all 60, each once
    assert sorted(body[0] for name, body in queued_tasks(broker) if name == "core.dispatch_event") == sorted(sent)


def test_staff_requeue_stuck_events_from_the_admin(outboxed, handlers, broker, django_capture_on_commit_callbacks):
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    with django_capture_on_commit_callbacks(execute=True):
        events.emit("test.happened", thing_id=1)
    row = OutboxEvent.objects.get()
    OutboxEvent.objects.filter(pk=row.pk).update(attempts=events.OUTBOX_MAX_ATTEMPTS)
    broker.delete("default")
    assert events.outbox_relay() == []  # stuck: the relay leaves it alone

    staff = Client()
    staff.force_login(get_user_model().objects.create_user(username="ops", is_staff=True))
    url = reverse("admin:core_outboxevent_changelist")
    page = staff.get(url)
    assert page.status_code == 200 and b"test.happened" in page.content
    done = staff.post(url, {"action": "requeue", "_selected_action": [row.pk]}, follow=True)
    assert b"1 event is due again;" in done.content  # was "1 event(s) are due again"
    assert OutboxEvent.objects.get().attempts == 0
    from portal.core.models import AuditLog

    (audit,) = AuditLog.objects.filter(action="outbox.requeue")
    assert (audit.actor.username, audit.object_id, audit.after) == ("ops", str(row.pk), {"event": "test.happened"})
    assert events.outbox_relay() == [row.pk]
    assert queued_tasks(broker) == [("core.dispatch_event", [row.pk])]

    member = Client()
    member.force_login(get_user_model().objects.create_user(username="someone"))
    assert member.get(url).status_code == 302  # to the login page: not for non-staff


@pytest.mark.django_db(transaction=True)
def test_a_second_copy_while_the_first_runs_leaves_the_event_to_it(outboxed, handlers, broker, monkeypatch):
    """The relay re-sent an event whose first message waited in a busy queue: both copies meet."""
    monkeypatch.setattr(tasks.dispatch_event, "apply_async", lambda *a, **k: None)  # keep the queue out of it
    events.emit("test.happened", thing_id=31)  # autocommit: committed at once
    outbox_id = OutboxEvent.objects.get().pk
    inside, release, runs, outcomes, errors = threading.Event(), threading.Event(), [], {}, []

    def slow(event, payload):
        runs.append(payload["thing_id"])
        inside.set()
        assert release.wait(20)

    def worker(name):
        try:
            outcomes[name] = tasks.dispatch_event(outbox_id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    events.subscribe("test.happened", slow, background=True)
    try:
        first = threading.Thread(target=worker, args=("first",))
        first.start()
        assert inside.wait(20)
        second = threading.Thread(target=worker, args=("second",))
        second.start()
        second.join(20)
        assert outcomes.get("second") == "busy"  # left alone while the first still runs
        release.set()
        first.join(20)
    finally:
        release.set()
        events.unsubscribe("test.happened", slow)
    assert not errors, errors
    assert outcomes == {"first": "done", "second": "busy"}
    assert runs == [31]  # the subscribers ran once
    assert not OutboxEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_copy_after_its_worker_died_goes_ahead_at_once(outboxed, handlers, broker, monkeypatch):
    """A worker killed mid-event: its session's lock goes with it, so the redelivered copy runs now."""
    import psycopg

    from portal.core.locks import LOCK_OUTBOX_EVENT

    monkeypatch.setattr(tasks.dispatch_event, "apply_async", lambda *a, **k: None)
    events.emit("test.happened", thing_id=41)
    outbox_id = OutboxEvent.objects.get().pk
    params = connection.get_connection_params()
    dead = psycopg.connect(**{k: v for k, v in params.items() if k not in ("cursor_factory", "context")},
                           autocommit=True)
    # The dead worker: it claimed the event and holds its lock, then its process is killed.
    dead.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_OUTBOX_EVENT, outbox_id])
    dead.execute("UPDATE core_outboxevent SET attempts = 1 WHERE id = %s", [outbox_id])
    assert tasks.dispatch_event(outbox_id) == "busy"  # alive: left to it
    dead.close()  # PostgreSQL drops the session's locks when it sees the socket close
    deadline = time.monotonic() + 10
    while (outcome := tasks.dispatch_event(outbox_id)) == "busy" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome == "done"
    assert [name for name, _, _ in handlers if name != "inline"] == ["bg1", "bg2"]
    assert not OutboxEvent.objects.exists()


def test_eager_tasks_run_the_woken_relay_inline_and_an_event_a_subscriber_emits(outboxed, handlers, broker, eager,
                                                                               django_capture_on_commit_callbacks):
    """CELERY_TASK_ALWAYS_EAGER (a developer's setup): the commit's wake-up runs the relay in the process, which
    runs each event's background subscribers; one of them emitting an event wakes a nested run that finds it."""
    def chain(event, payload):
        if payload["thing_id"] < 3:
            with transaction.atomic():
                events.emit("test.happened", thing_id=payload["thing_id"] + 1)

    events.subscribe("test.happened", chain, background=True)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            events.emit("test.happened", thing_id=0)
            events.emit("test.happened", thing_id=10)
    finally:
        events.unsubscribe("test.happened", chain)
    assert sorted(p["thing_id"] for name, _, p in handlers if name == "bg1") == [0, 1, 2, 3, 10]
    assert not OutboxEvent.objects.exists()  # every one handled, none left for the beat
    assert not relay_queued(broker) and queued_tasks(broker) == []
