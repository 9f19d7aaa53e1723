"""Production settings for real: they refuse to start without secrets, pass `check --deploy`, and a
gunicorn started from gunicorn.conf.py with two workers serves the security headers, JSON logs
with request ids, and one /metrics summed over both workers (Prometheus multiprocess mode)."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from tests.dburl import database_url

from .conftest import Scrape, promtool_check
from .servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def production_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "PORTAL_FERNET_KEYS")}
    env.update({
        "DJANGO_SETTINGS_MODULE": "portal.settings.production",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "PORTAL_FERNET_KEYS": Fernet.generate_key().decode(),
        "ALLOWED_HOSTS": "portal.example.com,127.0.0.1,localhost",
        "PYTHONPATH": str(ROOT),
    })
    env.update(extra)
    return env


def run(args, env, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.mark.parametrize("missing", ["SECRET_KEY", "PORTAL_FERNET_KEYS"])
def test_production_refuses_to_start_without_its_secrets(missing):
    env = production_env()
    env[missing] = ""
    result = run(["-c", "import django; django.setup()"], env)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and missing in result.stderr


def test_production_passes_djangos_security_deploy_checks():
    result = run(["manage.py", "check", "--deploy", "--tag", "security", "--fail-level", "WARNING"], production_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_production_settings_values():
    code = (
        "import json; from django.conf import settings as s; import django; django.setup();"
        "print(json.dumps({'hsts': s.SECURE_HSTS_SECONDS, 'sub': s.SECURE_HSTS_INCLUDE_SUBDOMAINS,"
        "'cookie': s.SESSION_COOKIE_SECURE, 'csrf': s.CSRF_COOKIE_SECURE, 'debug': s.DEBUG,"
        "'csrf_httponly': s.CSRF_COOKIE_HTTPONLY,"
        "'storage': s.STORAGES['staticfiles']['BACKEND'], 'mw': s.MIDDLEWARE, 'apps': s.INSTALLED_APPS,"
        "'csp': s.CONTENT_SECURITY_POLICY['DIRECTIVES']['default-src'],"
        "'fmt': s.LOGGING['formatters']['json']['()'], 'token': s.PORTAL_METRICS_TOKEN}))"
    )
    token_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"ops-token-{os.getpid()}"
    token_file.write_text("from-a-docker-secret\n")
    try:
        result = run(["-c", code], production_env(PORTAL_METRICS_TOKEN_FILE=str(token_file)))
    finally:
        token_file.unlink()
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout)
    assert s["hsts"] >= 31536000 and s["sub"] and s["cookie"] and s["csrf"] and not s["debug"]
    # No page script reads the CSRF cookie (htmx and the calendar take the token from the page).
    assert s["csrf_httponly"] is True
    assert s["storage"] == "whitenoise.storage.CompressedManifestStaticFilesStorage"
    mw = s["mw"]
    assert mw.count("portal.ops.logging.RequestIdMiddleware") == 1
    assert mw.count("portal.ops.metrics.RequestMetricsMiddleware") == 1
    # The request id exists before anything else can log.
    assert mw.index("portal.ops.logging.RequestIdMiddleware") < mw.index(
        "django.contrib.sessions.middleware.SessionMiddleware")
    assert "whitenoise.middleware.WhiteNoiseMiddleware" in s["mw"] and "csp.middleware.CSPMiddleware" in s["mw"]
    assert "portal.ops" in s["apps"]
    assert s["csp"] == ["'self'"] and s["fmt"] == "portal.ops.logging.JsonFormatter"
    assert s["token"] == "from-a-docker-secret"


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("GET", path, headers={"Host": "127.0.0.1", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


@pytest.mark.django_db
def test_gunicorn_serves_production_with_summed_metrics(tmp_path, redis_server):
    port = free_port()
    token_file = tmp_path / "metrics_token"
    token_file.write_text("scrape-me-" + secrets.token_hex(8))
    env = production_env(
        DATABASE_URL=database_url(), REDIS_URL=redis_server.url, CELERY_BROKER_URL=redis_server.url,
        PORT=str(port), WEB_CONCURRENCY="2", PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"),
        PORTAL_METRICS_TOKEN_FILE=str(token_file), PORTAL_METRICS_ALLOWED_NETWORKS="192.0.2.0/24",
        GUNICORN_BIND=f"127.0.0.1:{port}",
    )
    log = tmp_path / "gunicorn.log"
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "portal.wsgi:application"],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _, _ = _get(port, "/healthz")
                break
            except OSError:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        assert status == 200
        for _ in range(7):  # new connection each: spread over both workers
            assert _get(port, "/healthz")[0] == 200
        # Plain HTTP to the site is redirected to HTTPS; probes are exempt (above).
        status, headers, _ = _get(port, "/api/v1/pools/")
        assert status == 301 and headers["location"].startswith("https://")
        # Through the TLS proxy: security headers and a request id on every answer.
        status, headers, _ = _get(port, "/api/v1/pools/", {"X-Forwarded-Proto": "https",
                                                             "X-Request-ID": "probe-req-0001"})
        assert status == 401
        assert headers["strict-transport-security"].startswith("max-age=31536000")
        assert "default-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
        assert headers["x-request-id"] == "probe-req-0001"
        # /metrics: loopback is not an allowed network here, so only the token opens it.
        assert _get(port, "/metrics")[0] == 401
        assert _get(port, "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
        status, _, body = _get(port, "/metrics", {"Authorization": f"Bearer {token_file.read_text()}"})
        assert status == 200, body[:500]
        scrape = Scrape(body.decode())
        # 8 probes, answered by two processes, summed into one counter.
        assert scrape.value("portal_http_requests_total", method="GET", view="ops-healthz", status="200") == 8
        assert scrape.value("portal_metrics_source_up", source="database") == 1
        assert scrape.value("portal_metrics_source_up", source="broker") == 1
        result = promtool_check(scrape.text)
        assert result.returncode == 0, (result.stdout + result.stderr).decode()
        # Each worker writes its files once it has loaded the app (portal.ops.metrics pre-creates the
        # booking counters), which the second one may not have done yet when the first answers.
        deadline = time.monotonic() + 30
        while True:
            pids = {p.name.split("_")[-1].split(".")[0] for p in (tmp_path / "prom").glob("*.db")}
            if len(pids) >= 2 or time.monotonic() > deadline:
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert len(pids) >= 2, f"expected files from both workers, got {sorted(pids)}"
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    access = [e for e in lines if e.get("logger") == "portal.request" and e.get("request_id") == "probe-req-0001"]
    assert access and access[0]["http_status"] == 401, lines[-10:]
    assert any(e["logger"] == "gunicorn.error" for e in lines)
    assert all(set(e) >= {"ts", "level", "logger", "message"} for e in lines)


@pytest.mark.parametrize("entry", ["portal.wsgi", "portal.asgi", "portal.celery"])
def test_a_server_started_without_a_settings_module_gets_production_not_dev(entry):
    """gunicorn/uvicorn/celery pointed at the project with DJANGO_SETTINGS_MODULE forgotten must not run the
    dev settings (DEBUG on, a fixed secret key): production's, which refuse to start without their secrets."""
    env = {k: v for k, v in production_env().items() if k not in ("DJANGO_SETTINGS_MODULE", "SECRET_KEY")}
    result = run(["-c", f"import {entry}; import django; django.setup()"], env)
    assert result.returncode != 0 and "SECRET_KEY must be set in production" in result.stderr, result.stderr[-2000:]
    env = {k: v for k, v in production_env().items() if k != "DJANGO_SETTINGS_MODULE"}
    result = run(["-c", f"import {entry}; import django; django.setup(); from django.conf import settings; "
                        "print(settings.SETTINGS_MODULE, settings.DEBUG)"], env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["portal.settings.production", "False"]


# Every kind of answer production gives through the TLS proxy, from the view, the error handlers, the
# whitenoise static files and the middleware that answer before (or after) a view: each carries the headers.
_HEADER_PROBE = r"""
import json, django
django.setup()
from django.test import Client
from django.test.utils import override_settings
answers = {}
# No collectstatic here: the finders serve static files and templates name them unhashed.
with override_settings(WHITENOISE_USE_FINDERS=True,
                       STORAGES={"staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}):
    client = Client(HTTP_HOST="localhost", HTTP_X_FORWARDED_PROTO="https")
    for name, path in [("page", "/accounts/login/"), ("api", "/api/v1/pools/"), ("not_found", "/no/such/page/"),
                       ("api_not_found", "/api/v1/no-such/"), ("static", "/static/portal/portal.css"),
                       ("method_page", "/accounts/logout/"), ("nul_page", "/accounts/login/?next=a%00b"),
                       ("nul_api", "/api/v1/pools/?q=%00")]:
        r = client.get(path, secure=True)
        answers[name] = {"status": r.status_code, **{k.lower(): v for k, v in r.headers.items()}}
print(json.dumps(answers))
"""


@pytest.mark.django_db
def test_every_kind_of_answer_carries_the_security_headers():
    result = run(["-c", _HEADER_PROBE], production_env(DATABASE_URL=database_url()))
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert {name: a["status"] for name, a in answers.items()} == {
        "page": 200, "api": 401, "not_found": 404, "api_not_found": 404, "static": 200, "method_page": 405,
        "nul_page": 400, "nul_api": 400}
    for name, headers in answers.items():
        assert headers.get("x-content-type-options") == "nosniff", name
        assert headers.get("strict-transport-security", "").startswith("max-age=31536000"), name
        assert headers.get("referrer-policy") == "same-origin", name
        assert headers.get("cross-origin-opener-policy") == "same-origin", name
        csp = headers.get("content-security-policy", "")
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (name, csp)


# Sign in through the TLS proxy under production settings, as a browser would (CSRF enforced), and read the
# cookies' attributes as they are sent.
_COOKIE_PROBE = r"""
import json, re, secrets, django
django.setup()
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import override_settings

def attrs(morsel):
    return {"httponly": bool(morsel["httponly"]), "secure": bool(morsel["secure"]), "path": morsel["path"],
            "domain": morsel["domain"], "samesite": morsel["samesite"]}

name, password = "cookie-probe-" + secrets.token_hex(4), "pw-Long-enough-1"
user = get_user_model().objects.create_user(username=name, password=password)
# No collectstatic here: templates name static files unhashed.
static = {"staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}
client = None
try:
    with override_settings(STORAGES=static):
        client = Client(enforce_csrf_checks=True, HTTP_HOST="localhost", HTTP_X_FORWARDED_PROTO="https")
        page = client.get("/accounts/login/", secure=True)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)
        signed_in = client.post("/accounts/login/", {"username": name, "password": password,
                                                     "csrfmiddlewaretoken": token}, secure=True,
                                HTTP_ORIGIN="https://localhost", HTTP_REFERER="https://localhost/accounts/login/")
        home = client.get("/", secure=True)
    print(json.dumps({"csrf": {k: attrs(m) for k, m in page.cookies.items()}, "login": signed_in.status_code,
                      "session": {k: attrs(m) for k, m in signed_in.cookies.items()}, "home": home.status_code}))
finally:
    # The subprocess commits to the test database: leave no session behind (a later test counts the table's rows).
    from django.conf import settings
    from django.contrib.sessions.models import Session
    cookie = client.cookies.get(settings.SESSION_COOKIE_NAME) if client is not None else None
    if cookie is not None:
        Session.objects.filter(session_key=cookie.value).delete()
    user.delete()
"""


@pytest.mark.django_db
def test_production_cookies_are_host_only_secure_and_out_of_scripts_reach():
    result = run(["-c", _COOKIE_PROBE], production_env(DATABASE_URL=database_url()))
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.loads(result.stdout.strip().splitlines()[-1])
    # The CSRF cookie: no page script reads it (the pages carry the token), so scripts cannot.
    assert s["csrf"]["csrftoken"]["httponly"] and s["csrf"]["csrftoken"]["secure"]
    # The session cookie is __Host-: the browser takes it only from this host over HTTPS with Path=/ and no
    # Domain, so a sibling subdomain (or a plain-HTTP answer on one) cannot plant a session of its own.
    assert s["login"] == 302 and s["home"] == 200, s
    session = s["session"]["__Host-sessionid"]
    assert session == {"httponly": True, "secure": True, "path": "/", "domain": "", "samesite": "Lax"}
