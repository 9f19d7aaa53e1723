"""Beat entries of this app, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # Fold the availability summary's pending deltas into the per-slot rows (migration 0006).
    # Readers add pending deltas themselves, so this only bounds how many they must add.
    "reservations-slot-usage-compact": {
        "task": "reservations.slot_usage_compact",
        "schedule": 10.0,
        "options": {"expires": 9},
    },
    # Idempotency-Keys replay their booking for PORTAL_IDEMPOTENCY_KEY_TTL_HOURS (24); then they go.
    "reservations-idempotency-keys-prune": {
        "task": "reservations.idempotency_keys_prune",
        "schedule": 3600.0,
        "options": {"expires": 3000},
    },
}
