"""Beat entries of this app, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # The reservation lifecycle (DESIGN §5). `expires` drops ticks a stopped worker piled up:
    # each tick reads the whole state, so only the newest one matters.
    "provisioning-lifecycle-tick": {
        "task": "provisioning.lifecycle_tick",
        "schedule": 60.0,
        "options": {"expires": 55},
    },
}
