"""Expired sessions leave the database: every sign-in writes a django_session row, and Django never
deletes one by itself (only `clearsessions`, which nothing ran), so the table grew for ever.

The beat's core.sessions_prune deletes expired rows in bounded batches through the expire_date
index, each batch its own short transaction, skipping rows another prune has locked.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.sessions.models import Session
from django.utils import timezone

from portal.core import tasks
from portal.core.services import sessions_prune


def _session(key: str, expires_in: timedelta) -> None:
    Session.objects.create(session_key=key, session_data="x", expire_date=timezone.now() + expires_in)


@pytest.mark.django_db
def test_expired_sessions_are_pruned_in_batches_and_live_ones_stay():
    for i in range(5):
        _session(f"old{i}", -timedelta(days=1, minutes=i))
    _session("live", timedelta(hours=1))

    assert sessions_prune(batch=2) == 5  # three batches of at most 2 in one call
    # Its own rows: a session another test's subprocess committed (not rolled back with this test) may be there too.
    mine = Session.objects.filter(session_key__in=[f"old{i}" for i in range(5)] + ["live"])
    assert list(mine.values_list("session_key", flat=True)) == ["live"]
    assert sessions_prune(batch=2) == 0  # a second run finds nothing more


@pytest.mark.django_db
def test_a_run_stops_after_its_batch_budget():
    for i in range(5):
        _session(f"old{i}", -timedelta(days=1))
    assert sessions_prune(batch=2, max_batches=2) == 4
    assert sessions_prune(batch=2, max_batches=2) == 1


@pytest.mark.django_db
def test_beat_runs_the_prune():
    entries = [e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == "core.sessions_prune"]
    assert len(entries) == 1 and entries[0]["schedule"] <= 3600
    assert tasks.sessions_prune.name == "core.sessions_prune"
    _session("old", -timedelta(minutes=1))
    assert tasks.sessions_prune() == 1
