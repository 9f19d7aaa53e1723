"""gunicorn settings for the portal (docker-compose's web service and bench/availability.py).

Everything can be overridden from the environment: GUNICORN_BIND / PORT, WEB_CONCURRENCY,
GUNICORN_THREADS, GUNICORN_TIMEOUT, FORWARDED_ALLOW_IPS, PROMETHEUS_MULTIPROC_DIR.
"""

import os
import tempfile

bind = os.environ.get("GUNICORN_BIND") or f"0.0.0.0:{os.environ.get('PORT', '8000')}"
workers = int(os.environ.get("WEB_CONCURRENCY", str(min(2 * (os.cpu_count() or 1) + 1, 9))))
threads = int(os.environ.get("GUNICORN_THREADS", "1"))
worker_class = "gthread" if threads > 1 else "sync"
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "30"))
graceful_timeout = 30
keepalive = 5
# Recycle workers now and then so a slow leak can never take the site down.
max_requests = int(os.environ.get("GUNICORN_MAX_REQUESTS", "2000"))
max_requests_jitter = 200
# The TLS proxy in front sets X-Forwarded-Proto; trust it only from these addresses.
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")
# Heartbeat files on tmpfs: a container's overlay filesystem can stall workers.
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
# The portal writes its own JSON access-log line (portal.ops.logging.RequestIdMiddleware).
accesslog = None
errorlog = "-"
loglevel = os.environ.get("LOG_LEVEL", "info").lower()
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "portal.ops.logging.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "loggers": {
        "gunicorn.error": {"handlers": ["console"], "level": loglevel.upper(), "propagate": False},
        "gunicorn.access": {"handlers": ["console"], "level": "WARNING", "propagate": False},
    },
}
proc_name = "portal-web"
# gunicorn's logger, except that it builds no access line its WARNING-level access logger would drop.
logger_class = "portal.ops.weblog.WebLogger"

# Prometheus multiprocess mode: every worker writes its counters under this directory and the
# worker answering /metrics sums them. It must be set before a worker imports prometheus_client,
# i.e. here in the master; it is emptied at start so values of an earlier run never leak in.
# A directory made here is removed again when gunicorn exits (on_exit); one named by the operator stays.
_made_multiproc_dir = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _made_multiproc_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="portal-prometheus-")


def on_starting(server):
    from portal.ops import multiproc

    multiproc.reset()


def child_exit(server, worker):
    # prometheus_client's bookkeeping for a dead worker, and its counters folded into one archive file
    # per type: with max_requests recycling workers, their files would otherwise pile up and slow
    # every scrape (portal.ops.multiproc).
    from portal.ops import multiproc

    try:
        multiproc.mark_process_dead(worker.pid)
    except Exception:  # an exception here would stop the master
        server.log.exception("prometheus: could not fold the metric files of worker %s", worker.pid)


def on_exit(server):
    if _made_multiproc_dir:
        import shutil

        shutil.rmtree(_made_multiproc_dir, ignore_errors=True)
