"""The notification tasks that make deliveries, run twice at once (real threads, real PostgreSQL), make each once.

fanout_task is acknowledged late and retried on database errors; the beat's reminders and quota recheck may
overlap a slow run of themselves. Each copy here meets the other's uncommitted work and must not add to it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from notifications import services, tasks
from notifications.models import Delivery, QuotaAlertState
from notifications.slack import Event
from reservations import services as booking
from tenants.services import quota_update, tenant_slack_webhook_set
from tests.racing import in_turn

from ..conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)

SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"


@pytest.fixture
def world(notify_settings):
    world = make_world()
    tenant = tenant_slack_webhook_set(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], url=SLACK_URL)
    world.tenants["alpha"] = tenant
    services.slack_channel_ensure(tenant)
    return world


@pytest.fixture
def queued(monkeypatch) -> list[int]:
    """The deliveries queued for sending (instead of the broker), from any thread."""
    ids: list[int] = []
    monkeypatch.setattr(services, "_enqueue", lambda delivery_ids, **kw: ids.extend(delivery_ids))
    return ids


def _no_errors(results: list) -> None:
    assert not [r for r in results if isinstance(r, BaseException)], results


def test_a_fanout_redelivered_beside_itself_makes_and_queues_each_delivery_once(world, queued, t0):
    reservation = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                             pool=world.pool, node_count=1, start=t0, end=t0 + timedelta(hours=2))
    Delivery.objects.all().delete()  # the booking's own fan-out ran here: the copies below are its redeliveries
    queued.clear()
    payload = {"reservation_id": reservation.pk, "tenant_id": reservation.tenant_id}

    def hold():
        # One copy has made its deliveries and not yet committed; the two others meet them.
        assert len(services.event_fanout(event="reservation.confirmed", payload=payload)) == 1

    results = in_turn(hold, [lambda: tasks.fanout_task("reservation.confirmed", payload)] * 2)
    _no_errors(results)
    assert results == [0, 0]
    assert Delivery.objects.filter(event=Event.RESERVATION_CONFIRMED).count() == 1
    assert len(queued) == 1
    assert tasks.fanout_task("reservation.confirmed", payload) == 0 and len(queued) == 1


def test_two_reminder_runs_at_once_announce_each_reminder_once(world, queued):
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    soon = booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                      pool=world.pool, node_count=1, start=hour, end=hour + timedelta(hours=2))
    type(soon).objects.filter(pk=soon.pk).update(created_at=now - timedelta(days=1))
    queued.clear()

    def hold():
        assert [d.event for d in services.reminders_emit(now=now)] == [Event.RESERVATION_STARTING_1H]

    results = in_turn(hold, [lambda: services.reminders_emit(now=now)] * 2)
    _no_errors(results)
    assert results == [[], []]
    assert Delivery.objects.filter(event=Event.RESERVATION_STARTING_1H).count() == 1 and len(queued) == 1
    assert services.reminders_emit(now=now) == [] and len(queued) == 1


def test_two_quota_rechecks_at_once_alert_once(world, queued, t0):
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    booking.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], pool=world.pool,
                               node_count=4, start=t0, end=t0 + timedelta(hours=2))  # 4 of 5: 80 %
    # The booking's own check has not run (its fan-out is still queued): the beat's recheck finds the crossing.
    QuotaAlertState.objects.update_or_create(quota=quota, defaults={"above": False, "crossings": 0})
    Delivery.objects.filter(event=Event.QUOTA_THRESHOLD).delete()
    queued.clear()

    def hold():
        list(QuotaAlertState.objects.select_for_update().filter(quota=quota))

    results = in_turn(hold, [tasks.quota_recheck_task] * 2, waits_on="quotaalertstate")
    _no_errors(results)
    assert sorted(results) == [0, 1]
    assert Delivery.objects.filter(event=Event.QUOTA_THRESHOLD).count() == 1 and len(queued) == 1
    state = QuotaAlertState.objects.get(quota=quota)
    assert (state.above, state.crossings) == (True, 1)
    assert tasks.quota_recheck_task() == 0 and len(queued) == 1
