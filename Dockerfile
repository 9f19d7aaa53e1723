# syntax=docker/dockerfile:1
# GPU Portal: one image for web (gunicorn), Celery workers and beat. Multi-stage: the build stage
# installs the locked runtime dependencies (not the dev group) into a virtualenv and collects static
# files; the runtime stage copies only those and runs as an unprivileged user.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY requirements.lock pyproject.toml bin/runtime_requirements.py ./
# requirements.lock also pins the dev group (pytest, Playwright, ruff, …): install only the locked pins
# the runtime dependencies reach, exactly those (--no-deps), and let pip check that none is missing.
RUN python runtime_requirements.py requirements.lock > runtime-requirements.txt && pip install --no-deps -r runtime-requirements.txt && pip check
COPY manage.py gunicorn.conf.py ./
COPY portal ./portal
COPY tenants ./tenants
COPY reservations ./reservations
COPY provisioning ./provisioning
COPY notifications ./notifications
COPY templates ./templates
COPY static ./static
# Static files are collected at build time (whitenoise serves them with hashed names); the
# throwaway secrets below exist only for this step and never reach the runtime stage.
RUN DJANGO_SETTINGS_MODULE=portal.settings.production SECRET_KEY=collectstatic-only \
    PORTAL_FERNET_KEYS=Y29sbGVjdHN0YXRpYy1vbmx5LWtleS0zMi1ieXRlcyE= \
    python manage.py collectstatic --noinput

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    DJANGO_SETTINGS_MODULE=portal.settings.production PORT=8000
RUN groupadd --system portal && useradd --system --gid portal --home-dir /app --shell /usr/sbin/nologin portal
WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=portal:portal /app /app
USER portal
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["gunicorn", "-c", "gunicorn.conf.py", "portal.wsgi:application"]
