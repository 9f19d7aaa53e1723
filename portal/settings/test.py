"""pytest: real PostgreSQL and Redis, fast hashing, generous throttles unless a test lowers them."""

from .base import *  # noqa: F403
from .base import env

DEBUG = False
SECRET_KEY = "test-only-secret-key"  # noqa: S105
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# In-process tests see the effects of background event subscribers right after the commit
# (django_capture_on_commit_callbacks); tests/test_events.py covers the Celery path for real.
PORTAL_EVENTS_INLINE = True
PORTAL_THROTTLE_USER = "100000/min"
PORTAL_THROTTLE_ANON = "100000/min"
PORTAL_THROTTLE_BAD_TOKEN = "100000/min"
CACHES["default"]["KEY_PREFIX"] = env("CACHE_KEY_PREFIX", default="portal-test")  # noqa: F405
PORTAL_FERNET_KEYS = ["dGVzdC1vbmx5LWZlcm5ldC1rZXktMzItYnl0ZXMhISE="]
# Parallel test sessions on one machine (e.g. several developers' worktrees) each name their own database.
DATABASES["default"]["TEST"] = {"NAME": env("TEST_DB_NAME", default="test_portal")}  # noqa: F405
# The suite's webhook receivers listen on loopback; tests/notifications/test_egress.py holds the
# production default (public addresses only) with this off.
PORTAL_WEBHOOK_ALLOW_PRIVATE = True
