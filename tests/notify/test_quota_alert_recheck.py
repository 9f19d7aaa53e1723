"""The quota alert follows use that changes without a booking change: bookings that end as time passes,
and a quota lowered (or raised) under the tenant's bookings. Beat re-measures every quota
(``notifications.quota_recheck``); only a booking change did before."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError

from notifications import services
from notifications.models import Delivery, QuotaAlertState
from notifications.slack import Event
from portal.settings.base import CELERY_BEAT_SCHEDULE
from tenants.services import quota_update

pytestmark = pytest.mark.django_db

SLACK_URL = "https://hooks.slack.com/services/T000/B000/alpha-secret"


def _alerts():
    return list(Delivery.objects.filter(event=Event.QUOTA_THRESHOLD).order_by("pk"))


def test_use_that_fell_back_as_bookings_ended_rearms_the_alert(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    first = book("alpha", t0, hours=1, nodes=4)
    assert len(services.quota_threshold_check(tenant_id=first.tenant_id, pool_id=first.pool_id)) == 1

    # Two hours on, that booking is over and nothing was booked or cancelled meanwhile.
    later = t0 + timedelta(hours=2)
    assert services.quota_alerts_recheck(now=later) == []
    state = QuotaAlertState.objects.get(quota=quota)
    assert (state.above, state.last_peak) == (False, 0)

    # The team books up to 80 % again: a new crossing, and a new alert.
    second = book("alpha", t0 + timedelta(hours=3), hours=1, nodes=4)
    again = services.quota_threshold_check(tenant_id=second.tenant_id, pool_id=second.pool_id, now=later)
    assert len(again) == 1 and again[0].payload["used_nodes"] == 4
    assert QuotaAlertState.objects.get(quota=quota).crossings == 2
    assert len(_alerts()) == 2


def test_a_quota_lowered_under_the_bookings_alerts_at_the_next_recheck(world, t0, book, slack_for):
    slack_for("alpha", SLACK_URL)
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=10)
    reservation = book("alpha", t0, nodes=4)
    assert services.quota_threshold_check(tenant_id=reservation.tenant_id, pool_id=reservation.pool_id) == []

    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)  # 4 of 5: 80 %
    created = services.quota_alerts_recheck()
    assert [(d.payload["used_nodes"], d.payload["max_nodes"], d.payload["percent"]) for d in created] == [(4, 5, 80)]
    # Rechecking again, or a booking change, sends nothing more for this crossing.
    assert services.quota_alerts_recheck() == []
    assert services.quota_threshold_check(tenant_id=reservation.tenant_id, pool_id=reservation.pool_id) == []
    # Raised above the use again, the alert is re-armed.
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=10)
    assert services.quota_alerts_recheck() == []
    assert QuotaAlertState.objects.get(quota=quota).above is False
    assert len(_alerts()) == 1


@pytest.mark.parametrize("check", ["booking change", "recheck", "catch-up"])
def test_a_quota_check_that_failed_after_the_crossing_alerts_when_run_again(world, t0, book, slack_for, monkeypatch,
                                                                           check):
    # The crossing (state.above, crossings + 1) was committed before the alert's deliveries were made: a
    # fan-out failing in between (a database error, a worker killed) left the crossing counted and no alert,
    # and the task's retry (fanout_task retries database errors; the outbox re-runs a failed subscriber)
    # found the tenant already above: no crossing, so no alert, ever, for this climb.
    channel = slack_for("alpha", SLACK_URL)
    quota = world.tenants["alpha"].quotas.get()
    quota_update(actor=world.users["staff"], quota=quota, max_nodes=5)
    reservation = book("alpha", t0, nodes=4)  # 4 of 5: 80 %
    run = {
        "booking change": lambda: services.quota_threshold_check(tenant_id=reservation.tenant_id,
                                                                 pool_id=reservation.pool_id),
        "recheck": services.quota_alerts_recheck,
        "catch-up": lambda: services.quota_alerts_catch_up(channel_id=channel.pk),
    }[check]
    real = services._deliver_notices

    def lost_connection(notices):
        raise DatabaseError("server closed the connection unexpectedly")

    monkeypatch.setattr(services, "_deliver_notices", lost_connection)
    if check == "recheck":  # the beat's recheck logs a quota's failure and goes on with the others
        assert run() == []
    else:
        with pytest.raises(DatabaseError):
            run()
    monkeypatch.setattr(services, "_deliver_notices", real)

    created = run()  # the retry
    assert [(d.event, d.payload["used_nodes"]) for d in created] == [(Event.QUOTA_THRESHOLD, 4)]
    state = QuotaAlertState.objects.get(quota=quota)
    assert (state.above, state.crossings) == (True, 1)
    assert run() == [] and len(_alerts()) == 1  # and once only


def test_one_quota_failing_its_recheck_leaves_the_others_checked_and_is_retried_next_run(
        world, t0, book, slack_for, monkeypatch, caplog):
    """The beat's recheck ran every quota in one loop: one quota raising (a database error, a bad row) ended
    the run, so the quotas after it were not re-measured, their alerts not sent, at every run while it
    failed. Each quota is checked on its own now: a failure is logged, the rest go on, the next run retries."""
    slack_for("alpha", SLACK_URL)
    slack_for("beta", SLACK_URL.replace("alpha", "beta"))
    quotas = {slug: world.tenants[slug].quotas.get() for slug in ("alpha", "beta")}
    for slug, quota in quotas.items():
        quota_update(actor=world.users["staff"], quota=quota, max_nodes=10)
        book(slug, t0, nodes=2)
        quota_update(actor=world.users["staff"], quota=quota, max_nodes=2)  # 2 of 2: seen at the recheck
    assert quotas["alpha"].pk < quotas["beta"].pk  # the failing one comes first
    real = services._deliver_notices

    def alpha_fails(notices):
        if any(n.tenant_id == quotas["alpha"].tenant_id for n in notices):
            raise DatabaseError("deadlock detected")
        return real(notices)

    monkeypatch.setattr(services, "_deliver_notices", alpha_fails)
    with caplog.at_level("ERROR", logger="notifications.services"):
        created = services.quota_alerts_recheck()
    assert [d.payload["tenant"] for d in created] == [world.tenants["beta"].slug]
    assert any(f"quota #{quotas['alpha'].pk}" in r.getMessage() and r.exc_info for r in caplog.records)
    # The failed quota's crossing was not counted (rolled back with its alert): the next run sends it.
    assert not QuotaAlertState.objects.filter(quota=quotas["alpha"], crossings__gt=0).exists()
    monkeypatch.setattr(services, "_deliver_notices", real)
    again = services.quota_alerts_recheck()
    assert [d.payload["tenant"] for d in again] == [world.tenants["alpha"].slug]
    assert services.quota_alerts_recheck() == [] and len(_alerts()) == 2


def test_beat_runs_the_recheck():
    entry = next(e for e in CELERY_BEAT_SCHEDULE.values() if e["task"] == "notifications.quota_recheck")
    assert entry["schedule"] <= 900 and entry["options"]["expires"] < entry["schedule"]
    from notifications.tasks import quota_recheck_task

    assert quota_recheck_task.name == "notifications.quota_recheck"
