"""Changing a tenant's Slack subscriptions does not wait on bookings in flight. Real threads on the real database.

Bookings key-share the tenant row (reservations.services._RIGHTS_SQL) until they commit; slack_subscriptions_update
locked the row FOR UPDATE, which conflicts with that, so it queued behind every booking of a member in flight.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from notifications import services
from tenants.services import tenant_slack_webhook_set
from tests.racing import lock_waiters

from ..conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)


def _booking_in_flight(tenant_id: int, user_id: int, locked: threading.Event, release: threading.Event) -> None:
    """A member's booking between its rights check and its commit: its membership FOR SHARE, the tenant KEY SHARE."""
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT t.burst_enabled, m.role FROM tenants_tenant t JOIN tenants_membership m"
                        " ON m.tenant_id = t.id AND m.user_id = %s WHERE t.id = %s FOR SHARE OF m FOR KEY SHARE OF t",
                        [user_id, tenant_id])
            assert cur.fetchone() is not None
            locked.set()
            release.wait(30)
    finally:
        connection.close()


def _update(actor, tenant, result: dict) -> None:
    try:
        started = time.monotonic()
        services.slack_subscriptions_update(actor=actor, tenant=tenant, events=["reservation.confirmed"])
        result["seconds"] = time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        result["error"] = exc
    finally:
        connection.close()


def test_slack_subscriptions_do_not_wait_on_a_members_booking_in_flight(notify_settings):
    world = make_world()
    lead, member = world.users["alpha-lead"], world.users["alpha-member"]
    tenant = tenant_slack_webhook_set(actor=lead, tenant=world.tenants["alpha"],
                                      url="https://hooks.slack.com/services/T0/B0/alpha")
    locked, release = threading.Event(), threading.Event()
    booking = threading.Thread(target=_booking_in_flight, args=(tenant.pk, member.pk, locked, release))
    booking.start()
    assert locked.wait(10)
    result: dict = {}
    updater = threading.Thread(target=_update, args=(lead, tenant, result))
    updater.start()
    # Until it finishes or is seen queued on a lock: a fixed 5 s join failed a correct change that a loaded
    # machine ran slower than that, and said nothing of why.
    deadline = time.monotonic() + 120
    while updater.is_alive() and lock_waiters() == 0 and time.monotonic() < deadline:
        updater.join(0.02)
    finished_while_booking_held = not updater.is_alive()
    release.set()
    booking.join(30)
    updater.join(30)
    assert "error" not in result, result
    assert finished_while_booking_held, "slack_subscriptions_update waited on a booking's key-share lock"
    assert services.slack_channel_ensure(tenant).events == ["reservation.confirmed"]


def test_saving_slack_subscriptions_keeps_a_broken_flag_set_meanwhile(notify_settings):
    """A worker flags the channel broken (Slack answered channel_not_found) while the lead saves its events:
    the save must not write back the unbroken channel it had read, or the dead URL is posted to again."""
    from notifications import transport
    from notifications.models import Channel
    from tests.racing import behind_a_lock

    world = make_world()
    lead = world.users["alpha-lead"]
    url = "https://hooks.slack.com/services/T0/B0/alpha"
    tenant = tenant_slack_webhook_set(actor=lead, tenant=world.tenants["alpha"], url=url)
    channel = services.slack_channel_ensure(tenant)
    gone = transport.Outcome(transport.Verdict.PERMANENT, 404, "channel_not_found")

    result = behind_a_lock(
        lambda: services._mark_broken(channel.pk, url=url, outcome=gone),  # as _record does, under its lock
        lambda: services.slack_subscriptions_update(actor=lead, tenant=tenant, events=["reservation.confirmed"]),
        waits_on="notifications_channel",
    )

    assert not isinstance(result, Exception), result
    channel = Channel.objects.select_related("tenant").get(pk=channel.pk)
    assert channel.events == ["reservation.confirmed"]
    assert channel.is_broken and channel.broken_error == "channel_not_found"
