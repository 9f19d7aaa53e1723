"""Beat entries of the core app, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # The outbox relay's safety net: a commit wakes a run itself, and this one publishes the events
    # whose wake-up never left (the web process died after the commit, Redis or the broker was down:
    # due at once) or whose message was lost (due once its lease has passed).
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
