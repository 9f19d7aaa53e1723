"""Settings for the Celery worker the notification tests start: the test settings, faster clocks.

A short broker visibility timeout (and restore sweep) makes a message whose worker was
killed come back within seconds instead of an hour; short HTTP timeouts, leases and backoff
keep retries inside a test. Everything else is portal.settings.test, against the test
database and the test Redis passed in DATABASE_URL / REDIS_URL.
"""

import os

from portal.settings.test import *  # noqa: F403

CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": int(os.environ.get("NOTIFY_TEST_VISIBILITY_TIMEOUT", "4")),
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
PORTAL_BASE_URL = "https://portal.example.com"
PORTAL_NOTIFY_HTTP_TIMEOUT = float(os.environ.get("PORTAL_NOTIFY_HTTP_TIMEOUT", "3"))
PORTAL_NOTIFY_LEASE_SECONDS = float(os.environ.get("PORTAL_NOTIFY_LEASE_SECONDS", "4"))
PORTAL_NOTIFY_BACKOFF_BASE = 0.3
PORTAL_NOTIFY_BACKOFF_CAP = 2.0
PORTAL_NOTIFY_MIN_INTERVAL = 1.0
