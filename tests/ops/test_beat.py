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
