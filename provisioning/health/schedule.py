"""Beat entries of the health checks, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # Quick (read-only) checks of every node in service (DESIGN §5). A sweep skips nodes whose
    # previous check is still open, and `expires` drops sweeps a stopped worker piled up.
    "health-quick-sweep": {
        "task": "provisioning.health.sweep",
        "schedule": 300.0,
        "kwargs": {"level": "quick"},
        "options": {"expires": 280},
    },
    # Expire unanswered checks, finish consequences a crashed worker left, keep nodes in step
    # with their repairs, prune old scheduled results.
    "health-maintain": {
        "task": "provisioning.health.maintain",
        "schedule": 60.0,
        "options": {"expires": 55},
    },
}
