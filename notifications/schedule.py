"""Beat entries of this app, merged into CELERY_BEAT_SCHEDULE by the settings (no Django imports here)."""

BEAT: dict = {
    # Requeue deliveries whose task was lost (the delivery rows are the source of truth). Every entry
    # expires: after an outage, one run catches up; a backlog of 60 identical sweeps would only requeue
    # the same deliveries 60 times.
    "notifications-sweep": {"task": "notifications.sweep", "schedule": 60.0, "options": {"expires": 55}},
    # "Starts in 1 h", "ends in 24 h / 1 h"; the delivery key makes a repeat (or the lifecycle
    # tick announcing the same reminder) a no-op.
    "notifications-reminders": {"task": "notifications.reminders", "schedule": 60.0, "options": {"expires": 55}},
    # The quota alert's state follows use that changes without a booking change (bookings ending,
    # a quota edited in the admin): a tenant back under the threshold is re-armed, one pushed over
    # it by a lowered quota is told.
    "notifications-quota-recheck": {"task": "notifications.quota_recheck", "schedule": 900.0,
                                    "options": {"expires": 840}},
    # The delivery log is kept PORTAL_NOTIFY_RETENTION_DAYS (90) after a delivery finished.
    "notifications-prune": {"task": "notifications.prune", "schedule": 3600.0, "options": {"expires": 3000}},
}
