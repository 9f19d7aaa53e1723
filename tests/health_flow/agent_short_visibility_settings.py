"""The node agent's own settings with the broker's visibility timeout shrunk to seconds, so that a test sees in
seconds what a production agent sees after an hour: an unacknowledged message older than the timeout goes back
on its queue (kombu's Redis transport), whoever still holds it."""

from portal.settings.node_agent import *  # noqa: F403
from portal.settings.node_agent import CELERY_BROKER_TRANSPORT_OPTIONS

CELERY_BROKER_TRANSPORT_OPTIONS = {
    **CELERY_BROKER_TRANSPORT_OPTIONS,
    "visibility_timeout": 2,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
