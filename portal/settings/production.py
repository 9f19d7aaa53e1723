"""Production: secrets from the environment only; refuses to start without them.

Behind a TLS-terminating proxy that sets X-Forwarded-Proto. HSTS, secure cookies, a strict CSP
(django-csp 4), static files from whitenoise with hashed names, JSON logs with request ids, and
/healthz, /readyz, /metrics reachable over plain HTTP inside the deployment network.
"""

from pathlib import Path

from cryptography.fernet import Fernet
from csp.constants import NONCE, NONE, SELF
from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import INSTALLED_APPS, MIDDLEWARE, env, env_list

DEBUG = False

SECRET_KEY = env("SECRET_KEY", default="")
if not SECRET_KEY:
    raise ImproperlyConfigured("SECRET_KEY must be set in production")
PORTAL_FERNET_KEYS = env_list("PORTAL_FERNET_KEYS", default=[])
if not PORTAL_FERNET_KEYS:
    raise ImproperlyConfigured("PORTAL_FERNET_KEYS must be set in production (comma-separated Fernet keys)")
for _key in PORTAL_FERNET_KEYS:  # refuse to start, rather than fail at the first secret written
    try:
        Fernet(_key)
    except (ValueError, TypeError):
        raise ImproperlyConfigured(
            "PORTAL_FERNET_KEYS holds a value that is not a Fernet key (32 url-safe base64 bytes; make one with "
            "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')"
        ) from None
if SECRET_KEY.startswith("change-me"):
    raise ImproperlyConfigured("SECRET_KEY is still the .env.example placeholder")
# base.py's default (localhost only) stays; a real deployment names its hosts in ALLOWED_HOSTS.

# --- operations (portal.ops) -------------------------------------------------------------
if "portal.ops" not in INSTALLED_APPS:
    INSTALLED_APPS = [*INSTALLED_APPS, "portal.ops"]
_ops_middleware = ["portal.ops.logging.RequestIdMiddleware", "portal.ops.metrics.RequestMetricsMiddleware"]
MIDDLEWARE = [m for m in _ops_middleware if m not in MIDDLEWARE] + list(MIDDLEWARE)
# Prometheus: a bearer token (PORTAL_METRICS_TOKEN, or a file holding it, e.g. a Docker secret) and/or networks.
PORTAL_METRICS_TOKEN = env("PORTAL_METRICS_TOKEN", default="")
_token_file = env("PORTAL_METRICS_TOKEN_FILE", default="")
if _token_file and not PORTAL_METRICS_TOKEN:
    try:
        PORTAL_METRICS_TOKEN = Path(_token_file).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ImproperlyConfigured(
            f"PORTAL_METRICS_TOKEN_FILE={_token_file} does not exist (mount the metrics_token secret, or unset it)"
        ) from None
    except OSError as exc:  # a secret mounted 0600 for another user, a directory in its place, ...
        raise ImproperlyConfigured(
            f"PORTAL_METRICS_TOKEN_FILE={_token_file} cannot be read ({type(exc).__name__}: {exc.strerror or exc}); "
            "make it a file readable by the portal's user, or unset it"
        ) from None
    except UnicodeDecodeError as exc:  # a binary blob, or a token saved as UTF-16 by an editor
        raise ImproperlyConfigured(
            f"PORTAL_METRICS_TOKEN_FILE={_token_file} cannot be read (not UTF-8 text: byte "
            f"{exc.object[exc.start]:#04x} at offset {exc.start}); put the token in it as plain UTF-8 text, or unset it"
        ) from None
    if not PORTAL_METRICS_TOKEN:
        # Read as "no token", it would close /metrics to Prometheus too (no network is trusted here).
        raise ImproperlyConfigured(
            f"PORTAL_METRICS_TOKEN_FILE={_token_file} is empty (put a token in it, e.g. "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
# No network is trusted by default here: behind a reverse proxy on the same host every request
# arrives from loopback, so "allow loopback" would publish /metrics. List networks explicitly.
PORTAL_METRICS_ALLOWED_NETWORKS = env_list("PORTAL_METRICS_ALLOWED_NETWORKS", default=[])
PORTAL_READYZ_TIMEOUT = env.float("PORTAL_READYZ_TIMEOUT", default=2.0)

# --- HTTPS -------------------------------------------------------------------------------
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
# Probes and Prometheus talk plain HTTP to the container; never redirect them.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=True)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

# __Host-: the browser takes the session cookie only from this host, over HTTPS, with Path=/ and no Domain, so a
# sibling subdomain (or a plain-HTTP answer on one) cannot plant a session cookie of its own. Nothing outside
# the tests' (development settings) names the cookie; renaming it signs everyone in again once, at the upgrade.
SESSION_COOKIE_NAME = "__Host-sessionid"
SESSION_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = env.int("SESSION_COOKIE_AGE", default=60 * 60 * 12)
CSRF_COOKIE_SECURE = True
CSRF_COOKIE_SAMESITE = "Lax"
# No page script reads the CSRF cookie: htmx sends the token from <body hx-headers>, calendar.js from
# <meta name="csrf-token">, Swagger UI from its template; tests/browser/test_csrf_cookie_httponly.py books with
# it on. (Little against XSS, which can read the page's token; it keeps the cookie out of document.cookie.)
CSRF_COOKIE_HTTPONLY = True
LANGUAGE_COOKIE_SECURE = True

# --- Content Security Policy (django-csp 4) ----------------------------------------------
# Everything is served from this origin (vendored JS/CSS, no CDN). Inline <script> needs the
# per-request nonce: <script nonce="{{ request.csp_nonce }}">. Inline styles stay allowed for
# htmx's indicator styles and Swagger UI; style injection is not script execution.
# Right after SecurityMiddleware, outside every middleware that answers a request itself: the NUL 400,
# whitenoise's static files and the 405 page are rendered above the views, and a CSP middleware below
# them (the last in the list) never saw those answers, which went out with no policy at all.
if "csp.middleware.CSPMiddleware" not in MIDDLEWARE:
    _security = MIDDLEWARE.index("django.middleware.security.SecurityMiddleware")
    MIDDLEWARE = [*MIDDLEWARE[:_security + 1], "csp.middleware.CSPMiddleware", *MIDDLEWARE[_security + 1:]]
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        "style-src": [SELF, "'unsafe-inline'"],
        "img-src": [SELF, "data:"],
        "font-src": [SELF, "data:"],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
        "upgrade-insecure-requests": True,
    },
}
_csp_report_uri = env("CSP_REPORT_URI", default="")
if _csp_report_uri:
    CONTENT_SECURITY_POLICY["DIRECTIVES"]["report-uri"] = [_csp_report_uri]

# --- static files: whitenoise with compressed, content-hashed names ----------------------
STORAGES["staticfiles"] = {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"}  # noqa: F405
WHITENOISE_MAX_AGE = 60 * 60 * 24 * 365  # hashed names never change content

# --- database ----------------------------------------------------------------------------
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=60)  # noqa: F405
DATABASES["default"].setdefault("OPTIONS", {})  # noqa: F405
DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", env.int("DB_CONNECT_TIMEOUT", default=5))  # noqa: F405

# --- Celery: keep our JSON logging in workers ---------------------------------------------
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_SEND_TASK_EVENTS = env.bool("CELERY_WORKER_SEND_TASK_EVENTS", default=False)

# --- logging: one JSON object per line on stderr ------------------------------------------
LOG_LEVEL = env("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "portal.ops.logging.JsonFormatter"}},
    "filters": {"request_id": {"()": "portal.ops.logging.RequestIdFilter"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "json", "filters": ["request_id"]},
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # Our access-log line replaces django.server / django.request noise for each request.
        "django.request": {"level": "ERROR"},
        "django.security.DisallowedHost": {"level": "ERROR"},
        "celery": {"level": LOG_LEVEL},
        "gunicorn.error": {"level": LOG_LEVEL},
    },
}

ADMINS = [("Platform team", a) for a in env_list("ADMIN_EMAILS", default=[])]
SERVER_EMAIL = env("SERVER_EMAIL", default="portal@localhost")
# The SMTP server those mails go through: smtp://host:25, smtp+tls://user:password@host:587 (STARTTLS),
# smtp+ssl://user:password@host:465. Unset, Django's default (localhost:25), where nothing listens in a
# container. Percent-encode an "@" or "/" in the user or password.
if env("EMAIL_URL", default=""):
    try:
        _email = env.email_url("EMAIL_URL")
    except ImproperlyConfigured as exc:
        raise ImproperlyConfigured(f"EMAIL_URL: {exc} (smtp://, smtp+tls:// or smtp+ssl://)") from None
    EMAIL_BACKEND = _email["EMAIL_BACKEND"]
    EMAIL_HOST = _email["EMAIL_HOST"]
    EMAIL_PORT = _email.get("EMAIL_PORT") or (465 if _email.get("EMAIL_USE_SSL") else 25)
    EMAIL_HOST_USER = _email.get("EMAIL_HOST_USER") or ""
    EMAIL_HOST_PASSWORD = _email.get("EMAIL_HOST_PASSWORD") or ""
    EMAIL_USE_TLS = bool(_email.get("EMAIL_USE_TLS"))
    EMAIL_USE_SSL = bool(_email.get("EMAIL_USE_SSL"))

# Clusters are handed over only when their nodes pass the medium GPU checks (provisioning/health).
PORTAL_ACCEPTANCE_GATE = env("PORTAL_ACCEPTANCE_GATE", default="provisioning.health.services.health_acceptance_gate")
