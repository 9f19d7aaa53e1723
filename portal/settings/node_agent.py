"""The GPU node's health agent (`python -m provisioning.health.worker node`): the broker, none of the portal's secrets.

The agent runs checks it takes from its own ``node.<hostname>`` queue and posts the reports back on the broker
(provisioning/health/tasks.py). It has no database, no sessions, nothing it signs and nothing it decrypts, and a
node is handed to tenants: SECRET_KEY and PORTAL_FERNET_KEYS are the portal's and stay off it. Its one credential is
the broker URL (CELERY_BROKER_URL, else REDIS_URL, with the broker's password in it); without one it refuses to
start rather than look for a broker on the node itself.
"""

import secrets

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import env

DEBUG = False

# Django wants a key; nothing the agent makes is signed with it, and nothing outlives the process.
SECRET_KEY = secrets.token_urlsafe(50)
PORTAL_FERNET_KEYS: list[str] = []  # nothing to decrypt; a call that would is an error, not a silent key

CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="") or env("REDIS_URL", default="")
if not CELERY_BROKER_URL:
    raise ImproperlyConfigured(
        "The node agent needs CELERY_BROKER_URL (or REDIS_URL): the portal's broker, where it takes its checks "
        "and posts its reports. It needs no SECRET_KEY, PORTAL_FERNET_KEYS or DATABASE_URL."
    )

CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# A check is acknowledged when it starts (a redelivered burn-in would run twice), so a prefetching agent would take
# the node's next message while a check runs and hold it unacknowledged: a medium check runs up to an hour and a full
# one four, past the broker's visibility timeout, when Redis puts the held message back on the queue and the agent
# then runs that check twice. Without prefetch the next check waits on the queue until the agent is free.
CELERY_WORKER_DISABLE_PREFETCH = True
