import os

from django.core.asgi import get_asgi_application

# A server pointed at this module without DJANGO_SETTINGS_MODULE gets production settings, which refuse to
# start without their secrets, rather than the dev ones (DEBUG on, a fixed secret key). `make run` sets dev.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.production")
application = get_asgi_application()
