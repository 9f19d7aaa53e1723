"""Beat entries of the core app, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # Domain events whose message never left the web process (it died after the commit, the
    # broker was down) or was lost are published again once their lease has passed.
    "core-outbox-relay": {
        "task": "core.outbox_relay",
        "schedule": 15.0,
        # Overlapping runs are harmless (SKIP LOCKED + lease), so a run late behind a queue
        # backlog still counts rather than expiring unrun.
        "options": {"expires": 120},
    },
    # Expired sessions: Django never deletes them itself; without this django_session grows by a
    # row per sign-in for ever.
    "core-sessions-prune": {
        "task": "core.sessions_prune",
        "schedule": 3600.0,
        "options": {"expires": 3000},
    },
}
