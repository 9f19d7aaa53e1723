"""Every beat entry names a task a worker actually registers (a typo would silently never run)."""

from __future__ import annotations

from django.conf import settings

from portal.celery import app


def test_every_beat_entry_names_a_registered_task():
    app.loader.import_default_modules()
    assert settings.CELERY_BEAT_SCHEDULE
    missing = {name: entry["task"] for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
               if entry["task"] not in app.tasks}
    assert missing == {}
    assert settings.CELERY_BEAT_SCHEDULE["reservations-slot-usage-compact"]["task"] == "reservations.slot_usage_compact"


def test_every_beat_entry_expires_so_an_outage_does_not_pile_up_runs():
    """With the workers down for an hour, each entry's messages expire instead of running back to back."""
    missing = [name for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
               if not entry.get("options", {}).get("expires")]
    assert missing == []
