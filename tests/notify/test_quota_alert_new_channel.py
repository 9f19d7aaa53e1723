"""A channel added (or enabled, or subscribed) while its tenant is above the quota threshold hears the current alert.

The alert is sent once per upward crossing. A channel that did not exist (or was switched off)
at the crossing would otherwise never learn that the tenant is at 80 %: it gets the current
alert once, and the channels that already got it are not told again.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection

from notifications import services
from notifications.choices import SUBSCRIBABLE_EVENTS
from notifications.models import Channel, Delivery
from notifications.slack import Event
from reservations import services as booking
from tenants.services import quota_update, tenant_slack_webhook_set

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"


def _above(world, t0, book, nodes: int = 4):
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    reservation = book("alpha", t0, nodes=nodes)
    return services.quota_threshold_check(tenant_id=reservation.tenant_id, pool_id=reservation.pool_id)


def _alerts(channel=None):
    qs = Delivery.objects.filter(event=Event.QUOTA_THRESHOLD)
    return list(qs.filter(channel=channel) if channel is not None else qs)


def test_a_webhook_added_while_above_gets_the_current_alert_once(world, t0, book, slack_for, webhook_for):
    slack = slack_for("alpha", SLACK_URL)
    first = _above(world, t0, book)
    assert [d.channel_id for d in first] == [slack.pk]

    channel, _ = webhook_for("alpha", "https://ci.alpha.example/hook")

    caught_up = _alerts(channel)
    assert len(caught_up) == 1
    assert caught_up[0].payload["used_nodes"] == 4 and caught_up[0].payload["percent"] == 80
    assert len(_alerts(slack)) == 1  # the Slack channel is not told again
    # Saving the webhook again (or another booking change) sends nothing new.
    services.webhook_update(actor=world.users["alpha-lead"], channel=channel, name="renamed")
    reservation = book("alpha", t0 + timedelta(hours=3), nodes=1)
    services.quota_threshold_check(tenant_id=reservation.tenant_id, pool_id=reservation.pool_id)
    assert len(_alerts(channel)) == 1 and len(_alerts(slack)) == 1


def test_a_webhook_enabled_or_subscribed_while_above_gets_it(world, t0, book, webhook_for):
    off, _ = webhook_for("alpha", "https://off.alpha.example/hook")
    services.webhook_update(actor=world.users["alpha-lead"], channel=off, enabled=False)
    unsubscribed, _ = webhook_for("alpha", "https://other.alpha.example/hook", events=[Event.RESERVATION_CONFIRMED])
    _above(world, t0, book)
    assert _alerts() == []  # nobody listening at the crossing

    services.webhook_update(actor=world.users["alpha-lead"], channel=off, enabled=True)
    services.webhook_update(actor=world.users["alpha-lead"], channel=unsubscribed, events=list(SUBSCRIBABLE_EVENTS))
    assert len(_alerts(off)) == 1 and len(_alerts(unsubscribed)) == 1
    # Off and on again within the same crossing: still the one alert.
    services.webhook_update(actor=world.users["alpha-lead"], channel=off, enabled=False)
    services.webhook_update(actor=world.users["alpha-lead"], channel=off, enabled=True)
    assert len(_alerts(off)) == 1


def test_a_slack_url_set_while_above_gets_the_alert(world, t0, book, notify_settings,
                                                    django_capture_on_commit_callbacks):
    _above(world, t0, book)
    with django_capture_on_commit_callbacks(execute=True):  # the event's subscribers run after the commit
        tenant_slack_webhook_set(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"], url=SLACK_URL)
    alerts = _alerts()
    assert len(alerts) == 1 and alerts[0].kind == "slack" and alerts[0].tenant_id == world.tenants["alpha"].pk


def test_slack_events_re_enabled_while_above_gets_the_alert(world, t0, book, slack_for):
    slack = slack_for("alpha", SLACK_URL, events=[Event.RESERVATION_CONFIRMED])
    _above(world, t0, book)
    assert _alerts() == []
    services.slack_subscriptions_update(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                        events=list(SUBSCRIBABLE_EVENTS))
    assert len(_alerts(slack)) == 1


def test_a_channel_added_below_the_threshold_gets_nothing(world, t0, book, webhook_for):
    _above(world, t0, book, nodes=2)  # 40 %
    channel, _ = webhook_for("alpha", "https://ci.alpha.example/hook")
    assert _alerts(channel) == []


def test_a_channel_added_after_the_use_fell_back_gets_nothing(world, t0, book, slack_for, webhook_for):
    slack_for("alpha", SLACK_URL)
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    big = book("alpha", t0, nodes=4)
    assert len(services.quota_threshold_check(tenant_id=big.tenant_id, pool_id=big.pool_id)) == 1
    # Cancelled without anyone re-checking (the fan-out has not run yet): the state still says above.
    booking.reservation_cancel(actor=world.users["alpha-lead"], reservation=big)
    channel, _ = webhook_for("alpha", "https://ci.alpha.example/hook")
    assert _alerts(channel) == []


def _race_crossing_and_new_channel(world, reservation, n: int) -> Channel:
    """Run the crossing's check and a new webhook's creation at once; return the new channel."""
    barrier = threading.Barrier(2)
    added: list[Channel] = []
    errors: list[Exception] = []

    def run(fn) -> None:
        try:
            barrier.wait()
            fn()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    def check() -> None:
        services.quota_threshold_check(tenant_id=reservation.tenant_id, pool_id=reservation.pool_id)

    def add() -> None:
        added.append(services.webhook_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                             url=f"https://ci{n}.alpha.example/hook", name=f"ci{n}")[0])

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (check, add)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    return added[0]


@pytest.mark.django_db(transaction=True)
def test_a_channel_added_while_the_crossing_is_announced_gets_the_alert_once(world, t0, book, slack_for):
    # The crossing's fan-out and the new channel's catch-up race: each channel, old and new, ends
    # with exactly one alert, whichever of the two reaches it first.
    slack = slack_for("alpha", SLACK_URL)
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    for n in range(1, 5):
        big = book("alpha", t0, nodes=4, name=f"big-{n}")
        added = _race_crossing_and_new_channel(world, big, n)
        crossing = f"{Event.QUOTA_THRESHOLD}:q{quota.pk}:n{n}|"
        for channel in (slack, added):
            assert Delivery.objects.filter(channel=channel, key__startswith=crossing).count() == 1, (n, channel)
        booking.reservation_cancel(actor=world.users["alpha-lead"], reservation=big)
        services.quota_threshold_check(tenant_id=big.tenant_id, pool_id=big.pool_id)  # re-armed
