"""Through a real Celery worker process: events to the receiver, retries, duplicate messages, kill -9.

One worker per module (it takes seconds to start); the kill test kills it with SIGKILL (the
whole process group: main process and pool children) mid-POST and starts a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.conf import settings
from standardwebhooks.webhooks import Webhook

from notifications.choices import AttemptVerdict, DeliveryStatus
from notifications.models import Delivery, DeliveryAttempt
from notifications.slack import Event
from notifications.tasks import deliver_task
from tests.dburl import database_url
from tests.notifications.receiver import Reply

pytestmark = [pytest.mark.celery, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
# notifications: fan-out and deliveries; default: core.dispatch_event, the background subscribers
# of domain events when they are not run inline (production's way, see the first test).
QUEUES = ("notifications", "default")


def wait_for(check: Callable[[], object], *, timeout: float = 30, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Worker:
    log_dir: Path
    proc: subprocess.Popen | None = None
    log: Path | None = None

    def start(self) -> Worker:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.notify.worker_settings",
            "DATABASE_URL": database_url(),
            "REDIS_URL": settings.REDIS_URL,
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
            "PYTHONUNBUFFERED": "1",
        }
        self.log = self.log_dir / f"worker-{uuid.uuid4().hex[:8]}.log"
        with self.log.open("wb") as handle:
            self.proc = subprocess.Popen(  # noqa: S603 - fixed argv
                [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", ",".join(QUEUES), "-c", "2",
                 "-P", "prefork", "-l", "info", "-n", f"notify-test-{uuid.uuid4().hex[:6]}@%h",
                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )
        wait_for(lambda: " ready." in self.output() or self.proc.poll() is not None, timeout=60, what="worker")
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.output()[-4000:]}")
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole worker: its own process group, main process and pool children."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def purge_queue() -> None:
    """Drop what earlier runs left in our Redis db (queue and unacked bookkeeping; this db is ours)."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    keys = [k for queue in QUEUES for k in client.scan_iter(match=f"{queue}*")]
    keys += [b"unacked", b"unacked_index", b"unacked_mutex"]
    client.delete(*keys)
    client.close()


def broker_pending() -> int:
    """Messages the broker may still hand a worker: queued, or delivered and not yet acknowledged.

    Tasks acknowledge late (CELERY_TASK_ACKS_LATE), so a message stays in ``unacked`` while its task
    runs; one left there past the visibility timeout (4 s here) goes back on its queue and runs again.
    """
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        queued = sum(client.llen(k) for queue in QUEUES for k in client.scan_iter(match=f"{queue}*", _type="list"))
        return queued + client.hlen("unacked")
    finally:
        client.close()


def wait_until_broker_idle(*, hold_s: float = 1.0, timeout: float = 60) -> None:
    """Wait until no message is queued or unacknowledged, and it stays so for ``hold_s``.

    Then nothing can be redelivered after the visibility timeout: a later POST would need a message.
    The hold covers a message between the queue and ``unacked`` (popped, not yet recorded by the worker).
    """
    deadline = time.monotonic() + timeout
    idle_since: float | None = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if broker_pending():
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= hold_s:
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for the broker to have nothing queued or unacked")


@pytest.fixture(scope="module")
def worker(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Worker]:
    with django_db_blocker.unblock():
        purge_queue()
        started = Worker(tmp_path_factory.mktemp("notify-worker")).start()
    try:
        yield started
    finally:
        started.kill(signal.SIGTERM)


def _delivered(pk: int) -> Delivery | None:
    delivery = Delivery.objects.get(pk=pk)
    return delivery if delivery.status == DeliveryStatus.DELIVERED else None


def test_booking_reaches_slack_and_the_signed_webhook(worker, world, t0, book, receiver, slack_for, webhook_for):
    slack_for("alpha", receiver.url("/services/T0/B0/alpha"))
    _, secret = webhook_for("alpha", receiver.url("/ci/hook"))

    reservation = book("alpha", t0, name="e2e")  # commits; the event goes subscriber -> fan-out -> deliver

    requests = receiver.wait_for(2, timeout_s=30)
    by_path = {r.path: r for r in requests}
    slack = by_path["/services/T0/B0/alpha"].json()
    assert slack["text"].startswith("Reservation confirmed: e2e") and slack["blocks"]
    envelope = Webhook(secret).verify(by_path["/ci/hook"].body, by_path["/ci/hook"].headers)
    assert envelope["type"] == Event.RESERVATION_CONFIRMED
    assert envelope["data"]["reservation_id"] == reservation.pk
    wait_for(lambda: Delivery.objects.filter(status=DeliveryStatus.DELIVERED).count() == 2, what="delivered")
    # Not a fixed pause: a message redelivered after the visibility timeout would post only seconds later.
    wait_until_broker_idle()
    assert len(receiver.requests) == 2  # once per channel, no more


def test_background_dispatch_reaches_the_receiver(worker, world, t0, book, receiver, webhook_for, settings):
    """As in production: the booking only wakes the outbox relay; the worker publishes core.dispatch_event, fans
    out and delivers."""
    settings.PORTAL_EVENTS_INLINE = False
    _, secret = webhook_for("alpha", receiver.url("/bg/hook"))

    reservation = book("alpha", t0, name="background")

    (request,) = receiver.wait_for(1, timeout_s=30)
    envelope = Webhook(secret).verify(request.body, request.headers)
    assert envelope["type"] == Event.RESERVATION_CONFIRMED
    assert envelope["data"]["reservation_id"] == reservation.pk
    assert "core.dispatch_event" in worker.output()
    wait_for(lambda: Delivery.objects.filter(status=DeliveryStatus.DELIVERED).count() == 1, what="delivered")


def test_worker_honours_backoff_and_retry_after(worker, world, t0, book, receiver, webhook_for):
    receiver.script(Reply.server_error(), Reply.rate_limited(2), Reply.ok())
    webhook_for("alpha", receiver.url("/ci/hook"))
    book("alpha", t0)
    delivery = wait_for(lambda: Delivery.objects.filter(event=Event.RESERVATION_CONFIRMED).first(), what="fan-out")

    wait_for(lambda: _delivered(delivery.pk), timeout=30, what="delivery after retries")
    first, second, third = receiver.wait_for(3)
    attempts = list(DeliveryAttempt.objects.filter(delivery=delivery).order_by("number"))
    assert [a.verdict for a in attempts] == [AttemptVerdict.RETRY, AttemptVerdict.RETRY, AttemptVerdict.DELIVERED]
    assert [a.status_code for a in attempts] == [500, 429, 200]
    # Each retry came no earlier than scheduled: backoff after the 500, Retry-After after the 429.
    assert second.received_at >= attempts[0].next_attempt_at.timestamp() - 0.3
    assert third.received_at - second.received_at >= 2.0
    assert len({r.headers["webhook-id"] for r in (first, second, third)}) == 1


def test_duplicate_messages_racing_in_two_processes_post_once(worker, world, t0, book, receiver, webhook_for):
    receiver.script(Reply(200, b"ok", delay_s=1.0))
    channel, _ = webhook_for("alpha", receiver.url("/ci/hook"))
    book("alpha", t0)
    delivery = wait_for(lambda: Delivery.objects.filter(channel=channel).first(), what="fan-out")
    # a redelivered message, the sweeper, an admin's retry… all at once
    duplicates = [deliver_task.apply_async(args=[delivery.pk]).id for _ in range(6)]

    wait_for(lambda: _delivered(delivery.pk), timeout=30, what="delivered")
    # Every duplicate runs to its end: one that found the delivery claimed comes back after the lease (4 s
    # here), one that found the send slot taken after the rate limit; a fixed wait asserted before they had.
    wait_for(lambda: all(f"notifications.deliver[{task_id}] succeeded" in worker.output() for task_id in duplicates),
             timeout=60, what="every duplicate task to finish")
    assert len(receiver.requests) == 1
    assert DeliveryAttempt.objects.filter(delivery=delivery).count() == 1


def test_nothing_lost_when_the_worker_is_killed_mid_delivery(worker, world, t0, book, receiver, webhook_for):
    receiver.script(Reply.slow(60))  # the first POST hangs: the worker is mid-delivery when killed
    channel, secret = webhook_for("alpha", receiver.url("/ci/hook"))
    book("alpha", t0)
    receiver.wait_for(1, timeout_s=30)
    worker.kill(signal.SIGKILL)

    delivery = Delivery.objects.get(channel=channel)
    assert delivery.status == DeliveryStatus.SENDING  # claimed, never finished
    assert DeliveryAttempt.objects.get(delivery=delivery).verdict == AttemptVerdict.SENDING

    worker.start()  # acks_late: the unacknowledged message comes back to the new worker
    wait_for(lambda: _delivered(delivery.pk), timeout=40, what="delivery after restart")
    wait_until_broker_idle()  # every copy of the message has run and been acknowledged: none left to come back

    requests = receiver.requests
    assert len(requests) == 2  # the interrupted POST and the one that got its 200
    assert {r.headers["webhook-id"] for r in requests} == {delivery.message_id}  # one message, de-duplicable
    for request in requests:
        Webhook(secret).verify(request.body, request.headers)
    assert Delivery.objects.filter(channel=channel).count() == 1
    verdicts = list(DeliveryAttempt.objects.filter(delivery=delivery).order_by("number").values_list("verdict",
                                                                                                      flat=True))
    assert verdicts == [AttemptVerdict.INTERRUPTED, AttemptVerdict.DELIVERED]
    assert Delivery.objects.get(pk=delivery.pk).delivered_at is not None


def test_sweeper_requeues_a_delivery_whose_message_was_lost(worker, world, t0, receiver, webhook_for, book):
    from notifications import services

    channel, _ = webhook_for("alpha", receiver.url("/ci/hook"))
    reservation = book("alpha", t0)
    delivery = wait_for(lambda: Delivery.objects.filter(channel=channel).first(), what="fan-out")
    wait_for(lambda: _delivered(delivery.pk), what="first delivery")
    # A delivery row whose task never reached the broker (Redis lost it): only the sweeper knows.
    lost = Delivery.objects.create(
        key=f"lost:{reservation.pk}", channel=channel, channel_label=channel.label, kind=channel.kind,
        tenant=channel.tenant, event=Event.RESERVATION_CHANGED, message_id="msg_lost", payload={}, body="{}",
        next_attempt_at=delivery.created_at - timedelta(minutes=5),
    )
    assert services.deliveries_requeue_stuck() == [lost.pk]
    wait_for(lambda: _delivered(lost.pk), timeout=30, what="swept delivery")
    assert receiver.requests[-1].headers["webhook-id"] == "msg_lost"
