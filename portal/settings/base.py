"""Settings shared by every environment; everything that varies comes from the environment."""

import os
from pathlib import Path
from urllib.parse import unquote

import environ

from notifications.schedule import BEAT as _notifications_beat
from portal.core.schedule import BEAT as _core_beat
from provisioning.health.schedule import BEAT as _health_beat
from provisioning.schedule import BEAT as _provisioning_beat
from reservations.schedule import BEAT as _reservations_beat

BASE_DIR = Path(__file__).resolve().parent.parent.parent

env = environ.Env()


def env_list(name: str, default: list[str]) -> list[str]:
    """A comma-separated list setting: spaces around each entry stripped, empty entries dropped.

    django-environ's env.list keeps them, so ALLOWED_HOSTS="a.com, b.com" would allow " b.com" (and answer
    every request to b.com with a 400). The default applies only when the variable is unset.
    """
    return [item.strip() for item in env.list(name, default=default) if item.strip()]

# A developer's var/dev.env (written by bin/devservices.py) fills in DATABASE_URL/REDIS_URL
# for the embedded services; real environment variables always win. Never under the production
# or node agent settings: on a host where `make services` once ran, they must not quietly use those.
_dev_env = BASE_DIR / "var" / "dev.env"
if _dev_env.exists() and not os.environ.get("DJANGO_SETTINGS_MODULE", "").endswith((".production", ".node_agent")):
    environ.Env.read_env(str(_dev_env), overwrite=False)

SECRET_KEY = env("SECRET_KEY", default="")
DEBUG = env.bool("DEBUG", default=False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "simple_history",
    "portal.core",
    "portal.ops",
    "tenants",
    "reservations",
    "provisioning",
    "provisioning.health",
    "notifications",
]

MIDDLEWARE = [
    "portal.ops.logging.RequestIdMiddleware",
    "portal.ops.metrics.RequestMetricsMiddleware",
    # Outside everything that answers a request: HSTS, nosniff and the referrer policy on every answer,
    # the 400 below included.
    "django.middleware.security.SecurityMiddleware",
    "portal.core.middleware.RejectNulMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "portal.core.middleware.CommonMiddleware",  # Django's, with a 308 for the trailing slash
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "simple_history.middleware.HistoryRequestMiddleware",
    "portal.pages.MethodNotAllowedPageMiddleware",  # a page, not an empty body, for a GET of an action
    "portal.pages.BusyPageMiddleware",  # 503 + Retry-After, not a 500, for a write that lost a deadlock
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.core.context_processors.portal",
            ],
        },
    },
]

# PostgreSQL only: range types, GiST exclusion constraints and row locks are the design.
DATABASES = {"default": env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/portal")}
# A Unix-socket directory arrives percent-encoded in the URL host (postgres://u@%2Fpath/db).
DATABASES["default"]["HOST"] = unquote(DATABASES["default"].get("HOST") or "")
DATABASES["default"]["ATOMIC_REQUESTS"] = False  # services own their (durable) transactions
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Parameters travel separately from the SQL (server-side binding) and a statement run twice on a
# connection is prepared once: PostgreSQL then neither re-parses nor re-plans the booking path's
# statements, and psycopg need not quote parameters into the text in Python. Behind a PgBouncer
# older than 1.21 in transaction mode (no prepared statements), set DB_PREPARE_THRESHOLD=-1.
DATABASES["default"].setdefault("OPTIONS", {})
DATABASES["default"]["OPTIONS"]["server_side_binding"] = env.bool("DB_SERVER_SIDE_BINDING", default=True)
_prepare_threshold = env.int("DB_PREPARE_THRESHOLD", default=2)
DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None if _prepare_threshold < 0 else _prepare_threshold
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env("REDIS_URL", default="redis://127.0.0.1:6379/0")
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": env("CACHE_KEY_PREFIX", default="portal"),
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Bearer first: its WWW-Authenticate header makes DRF answer 401 (not 403) without credentials.
        "tenants.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "portal.core.drf.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_THROTTLE_CLASSES": [
        "portal.core.drf.UserThrottle",
        "portal.core.drf.AnonThrottle",
    ],
    "EXCEPTION_HANDLER": "portal.core.api.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["portal.core.drf.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "portal.core.drf.ContentNegotiation",
    "DATETIME_FORMAT": "%Y-%m-%dT%H:%M:%SZ",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    # Anonymous clients are told apart by address: REMOTE_ADDR unless PORTAL_NUM_PROXIES trusted
    # proxies stand in front (then the address they appended to X-Forwarded-For). Never the
    # whole client-supplied header, which anyone can fill with a fresh address per request.
    "NUM_PROXIES": env.int("PORTAL_NUM_PROXIES", default=0),
}
# Throttle rates are read per request (portal.core.throttle), so they can come from the environment.
PORTAL_THROTTLE_USER = env("PORTAL_THROTTLE_USER", default="1200/min")
PORTAL_THROTTLE_ANON = env("PORTAL_THROTTLE_ANON", default="120/min")
# Failed Bearer authentications per client address (tenants.auth): past it, 429 before the token lookup.
PORTAL_THROTTLE_BAD_TOKEN = env("PORTAL_THROTTLE_BAD_TOKEN", default="30/min")

SPECTACULAR_SETTINGS = {
    "TITLE": "GPU Portal API",
    "DESCRIPTION": "Book dedicated GPU nodes inside a quota; the database makes double-booking impossible.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # A reservation's, a cluster's and a health check's status share the field name: each enum keeps a
    # name of its own (StatusEnum stays the reservations').
    "ENUM_NAME_OVERRIDES": {"StatusEnum": "reservations.choices.ReservationStatus",
                            "ClusterStatusEnum": "provisioning.choices.ClusterStatus",
                            "CheckStatusEnum": "provisioning.health.choices.CheckStatus"},
    # Every field a response always carries is required; the error envelope of DESIGN §6 on every
    # operation, for the statuses it can answer.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "portal.core.schema.require_response_fields",
                             "portal.core.schema.add_error_responses"],
}

CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env.int("CELERY_TASK_TIME_LIMIT", default=600)
CELERY_TASK_SOFT_TIME_LIMIT = env.int("CELERY_TASK_SOFT_TIME_LIMIT", default=540)
# A broker that hangs rather than refuses (Redis paused, a network path dropping packets) must not hold a publish,
# and with it a web request or a task, for ever: each socket operation gives up after this long (the publish then
# fails; the caller logs it and the outbox, the tick or the sweeper sends it again).
CELERY_BROKER_SOCKET_TIMEOUT = env.float("CELERY_BROKER_SOCKET_TIMEOUT", default=5.0)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "socket_timeout": CELERY_BROKER_SOCKET_TIMEOUT,
    "socket_connect_timeout": CELERY_BROKER_SOCKET_TIMEOUT,
}
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_TASK_ROUTES = {
    "provisioning.health.*": {"queue": "health"},
    "provisioning.*": {"queue": "provisioning"},
    "notifications.*": {"queue": "notifications"},
}
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {**_core_beat, **_reservations_beat, **_provisioning_beat, **_health_beat, **_notifications_beat}

# Booking rules (DESIGN §4).
PORTAL_BOOKING_HORIZON_DAYS = env.int("PORTAL_BOOKING_HORIZON_DAYS", default=365)
PORTAL_BOOKING_MAX_ATTEMPTS = env.int("PORTAL_BOOKING_MAX_ATTEMPTS", default=12)
PORTAL_SUGGESTION_SEARCH_DAYS = env.int("PORTAL_SUGGESTION_SEARCH_DAYS", default=60)
# The largest JSON body the API parses (a booking is ~200 bytes; a bulk of anything stays far below).
PORTAL_API_MAX_BODY_BYTES = env.int("PORTAL_API_MAX_BODY_BYTES", default=1024 * 1024)
# An Idempotency-Key replays its booking for at least this long; older keys are pruned hourly.
PORTAL_IDEMPOTENCY_KEY_TTL_HOURS = env.int("PORTAL_IDEMPOTENCY_KEY_TTL_HOURS", default=24)
PORTAL_AVAILABILITY_MAX_SLOTS = 2000
PORTAL_PROVISIONING_BACKEND = env("PORTAL_PROVISIONING_BACKEND", default="simulated")
PORTAL_FERNET_KEYS = env_list("PORTAL_FERNET_KEYS", default=[])
PORTAL_BASE_URL = env("PORTAL_BASE_URL", default="http://127.0.0.1:8000")

# Notifications (notifications/): platform channel, demo receiver, delivery policy.
PORTAL_PLATFORM_SLACK_WEBHOOK = env("PORTAL_PLATFORM_SLACK_WEBHOOK", default="")
PORTAL_PLATFORM_SLACK_EVENTS = env_list("PORTAL_PLATFORM_SLACK_EVENTS", default=[])
# Tenants' webhook and Slack URLs must name public addresses (portal/core/egress.py: no probing of the
# platform's own network through the notifier); true lets them reach private and loopback ones.
PORTAL_WEBHOOK_ALLOW_PRIVATE = env.bool("PORTAL_WEBHOOK_ALLOW_PRIVATE", default=False)
PORTAL_DEMO_WEBHOOK_URL = env("PORTAL_DEMO_WEBHOOK_URL", default="")
PORTAL_DEMO_TENANT = env("PORTAL_DEMO_TENANT", default="research")
PORTAL_DEMO_WEBHOOK_SECRET = env("PORTAL_DEMO_WEBHOOK_SECRET", default="")
PORTAL_NOTIFY_HTTP_TIMEOUT = env.float("PORTAL_NOTIFY_HTTP_TIMEOUT", default=10.0)
PORTAL_NOTIFY_MAX_ATTEMPTS = env.int("PORTAL_NOTIFY_MAX_ATTEMPTS", default=12)
PORTAL_NOTIFY_QUOTA_THRESHOLD_PERCENT = env.int("PORTAL_NOTIFY_QUOTA_THRESHOLD_PERCENT", default=80)
# Signed webhooks one tenant may have (notifications.services.webhook_create refuses one more: quota_exceeded).
PORTAL_NOTIFY_MAX_WEBHOOKS = env.int("PORTAL_NOTIFY_MAX_WEBHOOKS", default=20)
# Finished deliveries (delivered, failed, skipped) leave the delivery log this long after their last change.
PORTAL_NOTIFY_RETENTION_DAYS = env.int("PORTAL_NOTIFY_RETENTION_DAYS", default=90)

# Operations (portal/ops): /metrics access, /readyz, queues watched.
PORTAL_METRICS_TOKEN = env("PORTAL_METRICS_TOKEN", default="")
PORTAL_METRICS_ALLOWED_NETWORKS = env_list("PORTAL_METRICS_ALLOWED_NETWORKS", default=["127.0.0.0/8", "::1/128"])
PORTAL_READYZ_TIMEOUT = env.float("PORTAL_READYZ_TIMEOUT", default=2.0)
PORTAL_CELERY_QUEUES = ["default", "provisioning", "health", "fleet", "notifications"]
# Background event subscribers (cluster creation, notification fan-out) run in a worker: the event
# is written to the outbox with the change, and the relay (woken by the commit) sends one core.dispatch_event
# message carrying its id;
# True runs them in the emitting process after commit instead (portal/core/events.py).
PORTAL_EVENTS_INLINE = env.bool("PORTAL_EVENTS_INLINE", default=False)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"},
        "json": {"()": "portal.ops.logging.JsonFormatter"},
    },
    "filters": {"request_id": {"()": "portal.ops.logging.RequestIdFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": env("LOG_FORMAT", default="plain"),
                             "filters": ["request_id"]}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="INFO")},
    # Django's DEFAULT_LOGGING gives `django` a console handler of its own (DEBUG only) and lets it
    # propagate too: every django.* record came out twice under `make run`. Root's handler is enough.
    # urllib3 logs each request's full path at DEBUG, and a Slack incoming-webhook path is its secret:
    # LOG_LEVEL=DEBUG must not print tenants' webhook URLs.
    "loggers": {"django": {"handlers": [], "level": "INFO", "propagate": True},
                "urllib3": {"level": "INFO", "propagate": True}},
}
