"""The Celery app: JSON only, late acks, one task at a time per worker process."""

import os

from celery import Celery

# Without DJANGO_SETTINGS_MODULE, production settings (they refuse to start without their secrets), never the dev
# ones (DEBUG, a fixed secret key): importing `portal` runs this first, for the web server and workers alike.
# manage.py and `make run` set dev themselves.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.production")

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
