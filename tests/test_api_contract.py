"""The contract around the endpoints: schema, docs, tokens, throttling, unknown paths."""

import io
import json
import re

import pytest
import yaml
from django.core.management import call_command
from django.test import override_settings
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from tenants.models import ApiToken

from .conftest import forget_anon_throttle_budgets, forget_throttle_budgets

pytestmark = pytest.mark.django_db

DESIGN_PATHS = [
    "/api/v1/tenants/", "/api/v1/tenants/{slug}/", "/api/v1/users/", "/api/v1/memberships/", "/api/v1/pools/",
    "/api/v1/nodes/", "/api/v1/nodes/{id}/", "/api/v1/quotas/", "/api/v1/quotas/{id}/", "/api/v1/reservations/",
    "/api/v1/reservations/{id}/", "/api/v1/reservations/{id}/cancel/", "/api/v1/availability/",
    "/api/v1/clusters/", "/api/v1/clusters/{id}/", "/api/v1/clusters/{id}/health-checks/", "/api/v1/health-checks/",
]


def test_schema_is_valid_openapi_3_with_every_design_path(world):
    r = world.client("alpha-viewer").get("/api/schema/")
    assert r.status_code == 200
    spec = yaml.safe_load(r.content)
    assert spec["openapi"].startswith("3.")
    validate(spec)
    for path in DESIGN_PATHS:
        assert path in spec["paths"], path
    create = spec["paths"]["/api/v1/reservations/"]["post"]
    assert any(p["name"] == "Idempotency-Key" for p in create["parameters"])
    # Bearer tokens are declared (Swagger UI's Authorize button, generated clients) on every operation.
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "bearerFormat": "opaque"}
    operations = [op for item in spec["paths"].values() for op in item.values() if isinstance(op, dict)]
    secured = [op for op in operations if {"bearerAuth": []} in op.get("security", [])]
    assert operations and len(secured) == len(
        [op for op in operations if op.get("security") and op["security"] != [{}]])
    assert {"bearerAuth": []} in create["security"]
    # The error envelope of DESIGN §6 is documented where each status can happen.
    error = {"$ref": "#/components/schemas/Error"}
    assert spec["components"]["schemas"]["Error"]["required"] == ["code", "detail", "fields"]
    assert {"400", "401", "403", "409", "429"} <= set(create["responses"])
    assert create["responses"]["409"]["content"]["application/json"]["schema"] == error
    detail = spec["paths"]["/api/v1/reservations/{id}/"]["get"]["responses"]
    assert "404" in detail and "409" not in detail
    assert "404" in spec["paths"]["/api/v1/reservations/"]["get"]["responses"]  # a page past the end
    assert "404" not in create["responses"]
    # List filters are documented on the lists only, not on detail and action routes.
    def query(path, method="get"):
        return {p["name"] for p in spec["paths"][path][method].get("parameters", []) if p["in"] == "query"}
    assert {"status", "pool", "start", "end"} <= query("/api/v1/reservations/")
    assert query("/api/v1/reservations/{id}/") == set() == query("/api/v1/reservations/{id}/cancel/", "post")
    assert {"status", "reservation"} <= query("/api/v1/clusters/") and query("/api/v1/clusters/{id}/") == set()


def test_schema_generates_without_warnings_and_types_the_scoped_slugs():
    # --fail-on-warn: every field and view documents itself (a scoped slug field as its model's slug).
    out = io.StringIO()
    call_command("spectacular", "--fail-on-warn", "--format", "openapi-json", stdout=out)
    schemas = json.loads(out.getvalue())["components"]["schemas"]
    assert schemas["ReservationCreateRequest"]["properties"]["pool"] == {"type": "string", "minLength": 1}
    assert schemas["ReservationCreateRequest"]["properties"]["tenant"] == {"type": "string", "minLength": 1}
    assert schemas["MembershipInputRequest"]["properties"]["tenant"] == {"type": "string", "minLength": 1}


def test_a_non_negative_decimal_is_documented_without_a_minus(world):
    out = io.StringIO()
    call_command("spectacular", "--format", "openapi-json", stdout=out)
    pattern = json.loads(out.getvalue())["components"]["schemas"]["PoolInputRequest"]["properties"][
        "on_demand_rate"]["pattern"]
    assert re.fullmatch(pattern, "2.5") and re.fullmatch(pattern, "123456.1234")
    assert not re.fullmatch(pattern, "-1") and not re.fullmatch(pattern, "-0.5")
    # What the pattern refuses, the server refuses too: a client built from the schema finds no surprise.
    body = {"name": "neg", "gpu_model": "X", "gpus_per_node": 8, "on_demand_rate": "-1"}
    r = world.client("staff").post("/api/v1/pools/", body, format="json")
    assert r.status_code == 400 and "on_demand_rate" in r.json()["fields"]


def test_swagger_ui_is_served_locally(world):
    client = APIClient()
    client.force_login(world.users["alpha-viewer"])
    r = client.get("/api/docs/")
    assert r.status_code == 200
    html = r.content.decode()
    assert "swagger-ui" in html
    external = re.findall(r"""(?:src|href)=["'](https?://[^"']+)""", html)
    assert external == [], external


def test_redoc_is_served_locally_too(world):
    """drf-spectacular's Redoc page links Google Fonts (fonts.googleapis.com, fonts.gstatic.com): every visit told
    Google the reader's address and the page it came from, against "no CDN at run time" (DESIGN §2), and under the
    production Content-Security-Policy (style-src 'self') the stylesheet was refused with a violation report."""
    client = APIClient()
    client.force_login(world.users["alpha-viewer"])
    r = client.get("/api/redoc/")
    assert r.status_code == 200
    html = r.content.decode()
    assert "redoc.standalone.js" in html and 'spec-url="/api/schema/"' in html
    # The bundle's own logo (cdn.redoc.ly) is refused by the page itself, in every environment.
    policy = "img-src 'self' data:; font-src 'self' data:"
    assert f'<meta http-equiv="Content-Security-Policy" content="{policy}">' in html
    external = re.findall(r"""(?:src|href)=["'](https?://[^"']+)""", html)
    assert external == [], external


def test_issue_token_prints_a_working_token_last(world):
    out, err = io.StringIO(), io.StringIO()
    call_command("issue_token", "alpha-lead", stdout=out, stderr=err)
    token = out.getvalue().strip().splitlines()[-1]
    assert token.startswith("gpp_")
    assert not ApiToken.objects.filter(key_hash=token).exists()  # only the hash is stored
    assert ApiToken.objects.filter(key_hash=ApiToken.hash_key(token)).exists()
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert c.get("/api/v1/reservations/").status_code == 200


# What a shell can pass that PostgreSQL text cannot hold: a byte that is not UTF-8 reaches Python as a lone
# surrogate (os.fsdecode), and a NUL can come from call_command. Each was a traceback out of psycopg.
UNSTORABLE = ["bad\x00name", "bad\udcffname"]


@pytest.mark.parametrize("text", UNSTORABLE, ids=["NUL", "not UTF-8"])
@pytest.mark.parametrize("args", [
    lambda t: ["issue_token", t],
    lambda t: ["issue_token", "alpha-lead", "--name", t],
    lambda t: ["revoke_token", t],
    lambda t: ["revoke_token", "--user", t],
], ids=["issue username", "issue --name", "revoke prefix", "revoke --user"])
def test_token_commands_refuse_unstorable_text_with_a_message(world, args, text):
    from django.core.management.base import CommandError

    before = list(ApiToken.objects.order_by("pk").values_list("pk", "revoked"))
    with pytest.raises(CommandError) as refused:
        call_command(*args(text), stdout=io.StringIO(), stderr=io.StringIO())
    assert "\\x00" in str(refused.value) or "UTF-8" in str(refused.value), refused.value
    assert list(ApiToken.objects.order_by("pk").values_list("pk", "revoked")) == before


def test_issue_token_with_undecodable_bytes_exits_1_with_a_message_not_a_traceback(tmp_path):
    """From a real shell: the bytes are refused before any database work (here: none reachable)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"}
    for argv in ([b"issue_token", b"bad\xffname"], [b"revoke_token", b"--user", b"bad\xffname"]):
        done = subprocess.run([sys.executable, "manage.py", *argv], cwd=Path(__file__).resolve().parent.parent,
                              env=env, capture_output=True, timeout=120)  # noqa: S603
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 1, err
        assert "Traceback" not in err and err.startswith("CommandError: "), err


def test_issue_token_for_a_disabled_account_is_refused_instead_of_printing_a_dead_token(world):
    # Bearer authentication refuses every token of an inactive user: the command printed one anyway (exit 0),
    # which the caller then found answering 401 with nothing saying why.
    from django.core.management.base import CommandError

    user = world.users["alpha-lead"]
    user.is_active = False
    user.save(update_fields=["is_active"])
    before = ApiToken.objects.count()
    with pytest.raises(CommandError, match="disabled"):
        call_command("issue_token", "alpha-lead", stdout=io.StringIO(), stderr=io.StringIO())
    assert ApiToken.objects.count() == before


def test_revoked_token_is_refused(world):
    ApiToken.objects.filter(user=world.users["alpha-lead"]).update(revoked=True)
    r = world.client("alpha-lead").get("/api/v1/pools/")
    assert r.status_code == 401


def test_tokens_are_revoked_with_the_command_or_the_admin_and_can_expire(world):
    """A leaked token is stopped without touching the database by hand: revoke_token (by prefix or by
    user) or the admin's action; issue_token --expires-in-days gives one that lapses. All audited."""
    from datetime import timedelta

    from django.core.management.base import CommandError
    from django.test import Client
    from django.utils import timezone

    from portal.core.models import AuditLog

    def issue(*args):
        out = io.StringIO()
        call_command("issue_token", "alpha-lead", *args, stdout=out, stderr=io.StringIO())
        return out.getvalue().strip().splitlines()[-1]

    def status(key):
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
        return c.get("/api/v1/pools/").status_code

    first, second, third = issue("--name", "laptop"), issue(), issue("--expires-in-days", "30")
    assert status(first) == status(second) == status(third) == 200
    out = io.StringIO()
    call_command("revoke_token", first[:12], stdout=out)
    assert "revoked" in out.getvalue() and status(first) == 401 and status(second) == 200
    with pytest.raises(CommandError):
        call_command("revoke_token", first[:12], stdout=io.StringIO())  # no live token by that prefix any more
    expiring = ApiToken.objects.get(key_hash=ApiToken.hash_key(third))
    assert timedelta(days=29) < expiring.expires_at - timezone.now() <= timedelta(days=30)
    ApiToken.objects.filter(pk=expiring.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert status(third) == 401
    with pytest.raises(CommandError):
        issue("--expires-in-days", "0")
    # The admin lists tokens (never keys) and revokes the selected ones.
    admin = Client()
    admin.force_login(world.users["staff"].__class__.objects.create_superuser("root2", password="pw-Long-enough-1"))
    page = admin.get("/admin/tenants/apitoken/").content.decode()
    assert second[:12] in page and second not in page
    live = ApiToken.objects.get(key_hash=ApiToken.hash_key(second))
    r = admin.post("/admin/tenants/apitoken/", {"action": "revoke", "_selected_action": [live.pk]}, follow=True)
    assert r.status_code == 200 and status(second) == 401
    assert admin.get("/admin/tenants/apitoken/add/").status_code == 403
    actions = list(AuditLog.objects.filter(object_type="tenants.apitoken").values_list("action", flat=True))
    assert actions.count("token.issue") >= 3 and actions.count("token.revoke") == 2
    assert not any(key in str(AuditLog.objects.values_list("before", "after")) for key in (first, second, third))


def test_session_auth_needs_csrf_for_writes(world, t0):
    c = APIClient(enforce_csrf_checks=True)
    c.force_login(world.users["alpha-lead"])
    assert c.get("/api/v1/reservations/").status_code == 200
    r = c.post("/api/v1/reservations/", {"pool": "h100"}, format="json")
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"


def test_throttling_answers_429_with_retry_after(world):
    forget_throttle_budgets(world.users["alpha-viewer"])
    with override_settings(PORTAL_THROTTLE_USER="3/min"):
        c = world.client("alpha-viewer")
        codes = [c.get("/api/v1/pools/").status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = c.get("/api/v1/pools/")
        assert r.json()["code"] == "throttled" and int(r["Retry-After"]) >= 1


def test_default_rate_leaves_room_for_scripts():
    from django.conf import settings

    from portal.settings import base

    number, per = base.PORTAL_THROTTLE_USER.split("/")
    assert per.startswith("min") and int(number) >= 600
    assert settings.REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"]


def test_unknown_paths_and_methods_use_the_envelope(world):
    c = world.client("alpha-lead")
    r = c.get("/api/v1/nothing-here/")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = c.get("/api/v1/reservations/999999/")
    assert r.status_code == 404 and r.json() == {"code": "not_found", "detail": "Not found.", "fields": {}}
    r = c.put("/api/v1/reservations/1/", {}, format="json")
    assert r.status_code in (404, 405) and r.json()["code"] in ("not_found", "method_not_allowed")
    r = world.client("staff").delete("/api/v1/pools/h100/")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


def test_the_schema_documents_the_real_bodies_and_requires_every_field_they_always_carry(world):
    # Every field of these bodies is always present (null where nullable): a client generated from the
    # schema must not have to treat a node's state or a quota's burst_nodes as optional.
    spec = yaml.safe_load(world.client("staff").get("/api/schema/").content)
    schemas = spec["components"]["schemas"]

    def component(path, method, status):
        ref = spec["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    staff = world.client("staff")
    node, quota = world.nodes[0].pk, world.tenants["alpha"].quotas.get().pk
    bodies = [
        ("/api/v1/tenants/{slug}/", "get", "200", staff.get("/api/v1/tenants/alpha/").json()),
        ("/api/v1/pools/{name}/", "get", "200", staff.get("/api/v1/pools/h100/").json()),
        ("/api/v1/nodes/{id}/", "get", "200", staff.get(f"/api/v1/nodes/{node}/").json()),
        ("/api/v1/quotas/{id}/", "get", "200", staff.get(f"/api/v1/quotas/{quota}/").json()),
        ("/api/v1/memberships/", "post", "201", staff.post(
            "/api/v1/memberships/", {"tenant": "alpha", "user": "beta-lead", "role": "member"}, format="json").json()),
        ("/api/v1/users/", "post", "201", staff.post(
            "/api/v1/users/", {"username": "newbie", "password": "A-long-enough-pw-7"}, format="json").json()),
    ]
    for path, method, status, body in bodies:
        schema = component(path, method, status)
        assert set(schema["properties"]) == set(body), (path, sorted(schema["properties"]), sorted(body))
        assert set(schema.get("required", [])) == set(body), (path, sorted(schema.get("required", [])))
    listing = component("/api/v1/nodes/", "get", "200")
    assert set(listing["required"]) == {"count", "next", "previous", "results"}
    # A PATCH changes only what it names: no documented default for a client to fill in.
    patch = schemas["PatchedTenantInputRequest"]["properties"]
    assert not [name for name, prop in patch.items() if "default" in prop], patch


def test_the_schema_documents_the_retry_after_header_of_every_429(world):
    # DESIGN §6: a 429 comes "with Retry-After". A client generated from the schema reads a response header only
    # where the schema declares it; the header was named in the 429's description text alone.
    spec = yaml.safe_load(world.client("alpha-viewer").get("/api/schema/").content)
    operations = [op for item in spec["paths"].values() for op in item.values() if isinstance(op, dict)]
    throttled = [op["responses"]["429"] for op in operations if "429" in op.get("responses", {})]
    assert throttled and len(throttled) == len([op for op in operations if op.get("security") != [{}]])
    for response in throttled:
        header = response.get("headers", {}).get("Retry-After")
        assert header and header["schema"] == {"type": "integer", "minimum": 1}, response
    validate(spec)


def test_the_schema_states_availabilitys_step_rules(world):
    # DESIGN §6: step is in seconds, a multiple of the pool's slot, at most 2,000 slots a request. The schema gave
    # step as a bare integer (60 to a year), so a generated client learnt the rules from its first 400s.
    from django.conf import settings

    spec = yaml.safe_load(world.client("alpha-viewer").get("/api/schema/").content)
    params = {p["name"]: p for p in spec["paths"]["/api/v1/availability/"]["get"]["parameters"]}
    step = params["step"]["description"]
    assert "seconds" in step and "multiple of the pool's slot" in step, step
    assert f"{settings.PORTAL_AVAILABILITY_MAX_SLOTS:,} slots" in step, step
    assert "slot" in params["start"]["description"] and "step" in params["end"]["description"]


def test_the_reservation_lists_filters_are_documented_as_the_server_checks_them(world):
    # The reservations list refuses a status outside the reservation statuses (400 naming status), but the schema
    # gave status as any string: a generated client knew neither the values nor that others are refused (the
    # health-check and node lists document theirs as enums).
    from reservations.choices import ReservationStatus

    spec = yaml.safe_load(world.client("alpha-viewer").get("/api/schema/").content)
    params = {p["name"]: p for p in spec["paths"]["/api/v1/reservations/"]["get"]["parameters"]}
    assert sorted(params["status"]["schema"]["enum"]) == sorted(ReservationStatus.values)
    assert params["start"]["schema"]["format"] == params["end"]["schema"]["format"] == "date-time"
    assert params["pool"]["schema"]["type"] == "string"
    r = world.client("alpha-viewer").get("/api/v1/reservations/", {"status": "bogus"})
    assert r.status_code == 400 and "status" in r.json()["fields"]


def _response_validator(spec, path, method, status):
    """A validator for the body the schema documents at path/method/status (OpenAPI 3.0 semantics: nullable)."""
    from openapi_schema_validator import OAS30Validator

    schema = spec["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
    return OAS30Validator({**schema, "components": spec["components"]})


def test_a_reservation_whose_creator_was_deleted_matches_the_schema(world, t0):
    # created_by is null once the booking user's account is deleted (the foreign key is SET_NULL), and the API
    # says so, but the schema gave it as a plain string: a client generated from it refused the whole body (list
    # and detail alike) of any reservation booked by someone who has since left.
    from datetime import timedelta

    from django.contrib.auth import get_user_model

    from .conftest import iso

    booked = world.client("alpha-member").post("/api/v1/reservations/", {
        "pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}, format="json")
    assert booked.status_code == 201, booked.json()
    get_user_model().objects.filter(username="alpha-member").delete()
    lead = world.client("alpha-lead")
    spec = yaml.safe_load(lead.get("/api/schema/").content)
    detail = lead.get(f"/api/v1/reservations/{booked.json()['id']}/")
    assert detail.status_code == 200 and detail.json()["created_by"] is None
    errors = [e.message for e in _response_validator(spec, "/api/v1/reservations/{id}/", "get", "200").iter_errors(
        detail.json())]
    assert errors == []
    listing = lead.get("/api/v1/reservations/")
    assert [e.message for e in _response_validator(spec, "/api/v1/reservations/", "get", "200").iter_errors(
        listing.json())] == []


def test_the_schema_enumerates_cluster_statuses_where_they_are_read_and_filtered(world):
    # GET /api/v1/clusters/?status= refuses a value outside the cluster statuses (400 naming status), and a
    # cluster's status is one of them, but the schema gave both as any string (the comment on the phases said the
    # names were documented "on ClusterStatus", which the schema did not have): a generated client knew neither
    # the values it may filter by nor the ones it reads back.
    from provisioning.choices import ClusterStatus

    spec = yaml.safe_load(world.client("alpha-viewer").get("/api/schema/").content)
    params = {p["name"]: p for p in spec["paths"]["/api/v1/clusters/"]["get"]["parameters"]}

    def enum(schema):
        if "$ref" in schema:
            schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return sorted(schema.get("enum", []))

    assert enum(params["status"]["schema"]) == sorted(ClusterStatus.values)
    assert params["reservation"]["schema"] == {"type": "integer", "minimum": 1}
    assert enum(spec["components"]["schemas"]["Cluster"]["properties"]["status"]) == sorted(ClusterStatus.values)
    # The reservations' own status enum keeps its values (and its name) beside the clusters'.
    from reservations.choices import ReservationStatus

    assert sorted(spec["components"]["schemas"]["StatusEnum"]["enum"]) == sorted(ReservationStatus.values)
    r = world.client("alpha-viewer").get("/api/v1/clusters/", {"status": "bogus"})
    assert r.status_code == 400 and "status" in r.json()["fields"]


def test_a_request_django_refuses_before_the_api_answers_with_the_envelope(world):
    # Django refuses some requests itself, as SuspiciousOperation (more than DATA_UPLOAD_MAX_NUMBER_FIELDS query
    # parameters; a Host not in ALLOWED_HOSTS): under /api/ that 400 was Django's HTML "Bad Request (400)" page,
    # against DESIGN §6's one envelope for every 4xx (a client parsing the error read HTML).
    from django.conf import settings

    lead = world.client("alpha-lead")
    crowded = "&".join(f"x{i}=1" for i in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
    for r in (lead.get(f"/api/v1/reservations/?{crowded}"), lead.get(f"/api/v1/nothing-here/?{crowded}"),
              lead.get("/api/v1/reservations/", HTTP_HOST="elsewhere.example")):
        assert r.status_code == 400 and r["Content-Type"] == "application/json", r.content[:80]
        body = r.json()
        assert body["code"] == "invalid" and body["fields"] and set(body) == {"code", "detail", "fields"}, body
        assert "elsewhere.example" not in body["detail"]  # what the client sent is not echoed back
    # Outside the API, Django's page as before.
    page = world.client("alpha-lead").get(f"/reservations/?{crowded}")
    assert page.status_code == 400 and page["Content-Type"].startswith("text/html")


def test_the_schema_says_a_health_check_requests_nodes_may_not_be_empty(world):
    # POST /api/v1/clusters/{id}/health-checks/ refuses "nodes": [] (400 naming nodes: leave it out to check every
    # node), but the schema allowed an empty array: a client built from it learnt the rule from the 400.
    from provisioning.health.api import RequestInputSerializer

    spec = yaml.safe_load(world.client("alpha-viewer").get("/api/schema/").content)
    nodes = spec["components"]["schemas"]["RequestInputRequest"]["properties"]["nodes"]
    assert nodes["minItems"] == 1 and nodes["maxItems"] == 1000
    refused = RequestInputSerializer(data={"nodes": []})
    assert not refused.is_valid() and "nodes" in refused.errors
    assert RequestInputSerializer(data={"nodes": ["h100-001"]}).is_valid()


def test_the_schema_states_that_a_pools_slot_must_divide_a_day(world):
    # POST /api/v1/pools/ refuses a slot_minutes that does not divide 1440 (400 naming slot_minutes: the slots
    # tile a day), but the schema gave it as any integer from 1 to 1440 with no word of the rule, so 7 looked valid.
    spec = yaml.safe_load(world.client("staff").get("/api/schema/").content)
    slot = spec["components"]["schemas"]["PoolInputRequest"]["properties"]["slot_minutes"]
    assert "divide 1440" in slot.get("description", ""), slot
    r = world.client("staff").post("/api/v1/pools/", {"name": "odd", "gpu_model": "X", "gpus_per_node": 8,
                                                      "slot_minutes": 7}, format="json")
    assert r.status_code == 400 and "slot_minutes" in r.json()["fields"]


def test_the_schema_endpoints_errors_are_the_json_envelope_not_yaml(world):
    # /api/schema/ renders YAML by default, and its refusals were rendered by the same renderer: a throttled
    # client (anonymous: PORTAL_THROTTLE_ANON) or one asking ?format=xml got the envelope as YAML, typed
    # application/vnd.oai.openapi, where DESIGN §6 answers JSON with the one envelope.
    r = APIClient().get("/api/schema/", {"format": "xml"})
    assert r.status_code == 400 and r["Content-Type"] == "application/json", r.content[:80]
    assert r.json()["code"] == "invalid" and "format" in r.json()["fields"]
    address = "192.0.2.45"  # an address of its own, on a fresh budget: the first request passes, the second not
    forget_anon_throttle_budgets(address)
    with override_settings(PORTAL_THROTTLE_ANON="1/min"):
        client = APIClient(REMOTE_ADDR=address)
        assert client.get("/api/schema/").status_code == 200
        r = client.get("/api/schema/")
    assert r.status_code == 429 and r["Content-Type"] == "application/json", r.content[:80]
    assert r.json()["code"] == "throttled" and int(r["Retry-After"]) >= 1
    # The schema itself is unchanged: YAML by default, JSON when asked.
    assert APIClient().get("/api/schema/")["Content-Type"].startswith("application/vnd.oai.openapi")
    assert APIClient().get("/api/schema/", {"format": "json"}).json()["openapi"].startswith("3.")


def test_the_schema_enumerates_a_health_checks_level_trigger_status_and_verdict(world):
    # GET /api/v1/health-checks/ filters by level, trigger, status and verdict, documented as enums of the
    # model's choices, but a check's own fields were any strings in the schema: a generated client could filter
    # by values it then could not read back as the same type.
    from provisioning.health.choices import CheckLevel, CheckStatus, CheckTrigger, RecommendedAction, Verdict

    spec = yaml.safe_load(world.client("alpha-viewer").get("/api/schema/").content)
    schemas = spec["components"]["schemas"]

    def values(prop):
        refs = [prop] + prop.get("oneOf", []) + prop.get("allOf", [])
        out = set()
        for ref in refs:
            if "$ref" in ref:
                out |= set(schemas[ref["$ref"].rsplit("/", 1)[1]]["enum"])
        return out

    for name in ("HealthCheck", "HealthCheckDetail"):
        props = schemas[name]["properties"]
        assert values(props["level"]) == set(CheckLevel.values)
        assert values(props["trigger"]) == set(CheckTrigger.values)
        assert values(props["status"]) == set(CheckStatus.values)
        assert values(props["verdict"]) == {*Verdict.values, ""}  # blank until the check is done
        assert values(props["recommended_action"]) == {*RecommendedAction.values, ""}
    # The other statuses keep their own enums and names.
    assert "StatusEnum" in schemas and "ClusterStatusEnum" in schemas
    validate(spec)
    # Real bodies validate: one queued (no verdict yet) and one done.
    from provisioning.health.models import HealthCheck

    HealthCheck.objects.create(node=world.nodes[0], level=CheckLevel.QUICK, trigger=CheckTrigger.STAFF)
    HealthCheck.objects.create(node=world.nodes[1], level=CheckLevel.FULL, trigger=CheckTrigger.SCHEDULE,
                               status=CheckStatus.DONE, verdict=Verdict.FAIL,
                               recommended_action=RecommendedAction.values[0])
    listing = world.client("staff").get("/api/v1/health-checks/")
    assert listing.json()["count"] == 2 and {c["verdict"] for c in listing.json()["results"]} == {"", "fail"}
    assert [e.message for e in _response_validator(spec, "/api/v1/health-checks/", "get", "200").iter_errors(
        listing.json())] == []


def test_the_schema_states_the_idempotency_keys_limits(world, t0):
    # The booking refuses an Idempotency-Key over 255 characters (400 naming it), but the schema gave the header
    # as any string, with no word of what it does either.
    from datetime import timedelta

    from .conftest import iso

    spec = yaml.safe_load(world.client("alpha-lead").get("/api/schema/").content)
    header = next(p for p in spec["paths"]["/api/v1/reservations/"]["post"]["parameters"]
                  if p["name"] == "Idempotency-Key")
    assert header["in"] == "header" and header.get("required", False) is False
    assert header["schema"] == {"type": "string", "minLength": 1, "maxLength": 255}
    assert "original" in header["description"]
    body = {"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=1))}
    r = world.client("alpha-lead").post("/api/v1/reservations/", body, format="json",
                                        HTTP_IDEMPOTENCY_KEY="k" * 256)
    assert r.status_code == 400 and "Idempotency-Key" in r.json()["fields"]
