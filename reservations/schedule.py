"""Beat entries of this app, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # Fold the availability summary's pending deltas into the per-slot rows (migration 0006).
    # Readers add pending deltas themselves, so this only bounds how many they must add.
    "reservations-slot-usage-compact": {
        "task": "reservations.slot_usage_compact",
        "schedule": 10.0,
        "options": {"expires": 9},
    },
}
