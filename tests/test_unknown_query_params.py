"""A query parameter a route does not take is refused on every API v1 route (DESIGN §6: 400 invalid naming it,
and a rejected request changes nothing), not only on the lists: ``POST …/cancel/?force=true`` cancelled, and
``PATCH …?dry_run=1`` or ``POST /reservations/?dry_run=1`` made the real change, while the caller believed it
had asked for something else. The routes are enumerated from the URLconf, so a new one must join the table."""

from __future__ import annotations

import re
from datetime import timedelta
from urllib.parse import urlencode

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from portal.core import crypto
from provisioning.models import ClusterCredential, VirtualCluster

from . import test_bad_input_writes
from .conftest import iso
from .test_bad_input_writes import assert_refused, changed_tables, database_state

things = test_bad_input_writes.things  # the fixture: an alpha booking ahead with a pending cluster, one running

pytestmark = pytest.mark.django_db

API_PREFIX = "api/v1/"
QUERY_METHODS = ("get", "post", "put", "patch", "delete")


def api_routes() -> set[tuple[str, str]]:
    """Every (method, route) the URLconf serves under /api/v1/, routes written as the schema writes them."""
    found: set[tuple[str, str]] = set()

    def walk(patterns, prefix):
        for p in patterns:
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                route = prefix + str(p.pattern)
                if not route.startswith(API_PREFIX):
                    continue
                view = p.callback
                cls = getattr(view, "cls", None)
                assert cls is not None, f"{route} is no DRF view"
                actions = getattr(view, "actions", None)
                # DRF adds "head" (as "get") to a viewset's actions the first time the view serves a request: HEAD
                # is GET without the body, not a route of its own, so the table is the same before and after.
                methods = [m for m in actions if m != "head"] if actions else [m for m in QUERY_METHODS
                                                                             if hasattr(cls, m)]
                # Router regexes (^reservations/(?P<pk>[^/.]+)/cancel/$) and path() routes (<int:pk>), as {pk}.
                text = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", route).replace("^", "").replace("$", "")
                text = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", text)
                found.update((m, "/" + text) for m in methods)

    walk(get_resolver().url_patterns, "")
    return found


def _reservation_body(t0):
    return {"pool": "h100", "node_count": 1, "start": iso(t0 + timedelta(hours=12)),
            "end": iso(t0 + timedelta(hours=14)), "name": "dry run?"}


def _fail_pending(things):
    VirtualCluster.objects.filter(pk=things["pending"]).update(status="failed")


def _credential(things):
    ClusterCredential.objects.get_or_create(cluster_id=things["ready"], kind="ssh_key",
                                            defaults={"ciphertext": crypto.encrypt("key")})


# (method, route): who, the body (a valid one: without the refusal, the write would go ahead), and set-up.
ROUTES = {
    ("get", "/api/v1/tenants/"): ("staff", None, None),
    ("post", "/api/v1/tenants/"): ("staff", {"slug": "gamma", "name": "Gamma"}, None),
    ("get", "/api/v1/tenants/{slug}/"): ("staff", None, None),
    ("patch", "/api/v1/tenants/{slug}/"): ("staff", {"name": "Renamed"}, None),
    ("post", "/api/v1/users/"): ("staff", {"username": "newbie", "password": "Another-long-pw-9"}, None),
    ("get", "/api/v1/memberships/"): ("alpha-lead", None, None),
    ("post", "/api/v1/memberships/"): ("alpha-lead", {"tenant": "alpha", "user": "beta-viewer", "role": "viewer"},
                                       None),
    ("get", "/api/v1/quotas/"): ("staff", None, None),
    ("post", "/api/v1/quotas/"): ("staff", {"tenant": "alpha", "pool": "other", "max_nodes": 1}, None),
    ("get", "/api/v1/quotas/{pk}/"): ("staff", None, None),
    ("patch", "/api/v1/quotas/{pk}/"): ("staff", {"max_nodes": 2}, None),
    ("get", "/api/v1/pools/"): ("alpha-viewer", None, None),
    ("post", "/api/v1/pools/"): ("staff", {"name": "a100", "gpu_model": "A100", "gpus_per_node": 8}, None),
    ("get", "/api/v1/pools/{name}/"): ("alpha-viewer", None, None),
    ("get", "/api/v1/nodes/"): ("staff", None, None),
    ("post", "/api/v1/nodes/"): ("staff", {"hostname": "h100-009", "pool": "h100"}, None),
    ("get", "/api/v1/nodes/{pk}/"): ("staff", None, None),
    ("patch", "/api/v1/nodes/{pk}/"): ("staff", {"state": "maintenance", "state_reason": "fans"}, None),
    ("get", "/api/v1/reservations/"): ("alpha-viewer", None, None),
    ("post", "/api/v1/reservations/"): ("alpha-lead", "reservation", None),
    ("get", "/api/v1/reservations/{pk}/"): ("alpha-viewer", None, None),
    ("patch", "/api/v1/reservations/{pk}/"): ("alpha-lead", {"name": "renamed"}, None),
    ("post", "/api/v1/reservations/{pk}/cancel/"): ("alpha-lead", None, None),
    ("get", "/api/v1/availability/"): ("alpha-viewer", None, None),
    ("get", "/api/v1/usage/"): ("alpha-lead", None, None),
    ("get", "/api/v1/clusters/"): ("alpha-viewer", None, None),
    ("get", "/api/v1/clusters/{pk}/"): ("alpha-viewer", None, None),
    ("patch", "/api/v1/clusters/{pk}/"): ("alpha-lead", {"cuda_version": "12.4"}, None),
    ("post", "/api/v1/clusters/{pk}/teardown/"): ("alpha-lead", None, None),
    ("post", "/api/v1/clusters/{pk}/retry/"): ("staff", None, _fail_pending),
    ("get", "/api/v1/clusters/{pk}/credentials/{kind}/"): ("alpha-lead", None, _credential),
    ("post", "/api/v1/clusters/{pk}/health-checks/"): ("alpha-lead", {"level": "quick"}, None),
    ("get", "/api/v1/health-checks/"): ("alpha-viewer", None, None),
    ("get", "/api/v1/health-checks/{pk}/"): ("alpha-viewer", None, None),
}


def concrete(route: str, things, health_check: int) -> str:
    """route with its placeholders filled by objects the caller may reach."""
    pk = {"/api/v1/quotas/": things["quota"], "/api/v1/nodes/": things["node"],
          "/api/v1/reservations/": things["reservation"], "/api/v1/health-checks/": health_check}
    prefix = route.split("{")[0]
    if prefix.startswith("/api/v1/clusters/"):
        # A pending cluster for the spec change (and retry, once failed); teardown, credentials, checks on the ready.
        wants_pending = route.endswith("{pk}/") or route.endswith("/retry/")
        value = things["pending"] if wants_pending else things["ready"]
    else:
        value = pk.get(prefix)
    return (route.replace("{pk}", str(value)).replace("{slug}", "alpha").replace("{name}", "h100")
            .replace("{kind}", "ssh_key"))


@pytest.fixture
def health_check(world, things):
    """A finished check on a node of alpha's running booking (the POST route then queues fresh ones)."""
    from provisioning.health.models import HealthCheck
    from reservations.models import Allocation

    cluster = VirtualCluster.objects.get(pk=things["ready"])
    node = Allocation.objects.filter(reservation_id=cluster.reservation_id, active=True).first().node
    return HealthCheck.objects.create(node=node, reservation_id=cluster.reservation_id, level="quick",
                                      trigger="tenant", status="done", verdict="pass").pk


def test_the_table_covers_every_api_route():
    # A route added to the URLconf must join ROUTES (and so be tested below); a removed one must leave it.
    assert api_routes() == set(ROUTES), (sorted(api_routes() - set(ROUTES)), sorted(set(ROUTES) - api_routes()))


def _send(world, things, t0, health_check, method, route, query):
    from reservations.models import Pool

    who, body, prepare = ROUTES[(method, route)]
    Pool.objects.get_or_create(name="other", defaults={"gpu_model": "x", "gpus_per_node": 8})
    if prepare is not None:
        prepare(things)
    if body == "reservation":
        body = _reservation_body(t0)
    url = concrete(route, things, health_check)
    if route == "/api/v1/availability/":
        query = {"pool": "h100", **query}
    client = world.client(who)
    before = database_state()
    r = getattr(client, method)(f"{url}?{urlencode(query)}", body, format="json") if body is not None else \
        getattr(client, method)(f"{url}?{urlencode(query)}")
    return r, before


@pytest.mark.parametrize("method,route", sorted(ROUTES), ids=[f"{m}-{r}" for m, r in sorted(ROUTES)])
def test_an_unknown_query_parameter_is_refused_by_name_and_changes_nothing(world, t0, things, health_check, method,
                                                                          route):
    r, before = _send(world, things, t0, health_check, method, route, {"dry_run": "1", "force": "true"})
    assert_refused(r, "dry_run")
    assert set(r.json()["fields"]) == {"dry_run", "force"}, r.json()
    assert all("Unknown query parameter" in why for why in r.json()["fields"].values()), r.json()
    assert changed_tables(before) == []


@pytest.mark.parametrize("method,route", sorted(ROUTES), ids=[f"{m}-{r}" for m, r in sorted(ROUTES)])
def test_the_request_without_the_unknown_parameter_goes_ahead(world, t0, things, health_check, method, route):
    # The same request, ?format=json only (DRF's format override, which every route takes): answered, and a
    # write is made, so the refusal above is the parameter's doing.
    r, before = _send(world, things, t0, health_check, method, route, {"format": "json"})
    assert r.status_code < 300, (r.status_code, r.content[:300])
    if method != "get" or route.endswith("/credentials/{kind}/"):  # a download is audited
        assert changed_tables(before) != []


def test_every_documented_query_parameter_is_taken(world, t0, things, health_check):
    # The schema documents only what the routes take (and the routes take all it documents): each operation's
    # documented query parameters, sent together, are not refused as unknown (their values may still be wrong).
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    seen = set()
    for route, item in schema["paths"].items():
        for method, operation in item.items():
            key = (method, route.replace("{id}", "{pk}"))
            if key not in ROUTES:
                continue
            seen.add(key)
            names = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
            r, _ = _send(world, things, t0, health_check, method, key[1], dict.fromkeys(names, "1"))
            fields = r.json().get("fields", {}) if r.get("Content-Type") == "application/json" else {}
            assert not [f for f, why in fields.items() if "Unknown query parameter" in why], (key, r.json())
            # And the refusal's own list of what the route takes is what the schema documents (plus ?format=).
            r, _ = _send(world, things, t0, health_check, method, key[1], {"dry_run": "1"})
            takes = r.json()["fields"]["dry_run"].split("this request takes ", 1)[1].rstrip(".")
            assert set(takes.split(", ")) - {"none"} == set(names), (key, takes, names)
    assert seen == set(ROUTES)


def test_a_method_the_route_does_not_have_is_still_405(world, things):
    # The method is judged before the query: DELETE on a reservation is 405 whatever it carries.
    r = world.client("alpha-lead").delete(f"/api/v1/reservations/{things['reservation']}/?force=true")
    assert r.status_code == 405, r.content
    assert r.json()["code"] == "method_not_allowed"


def test_without_credentials_the_answer_is_still_401(world, things):
    r = world.client(None).post(f"/api/v1/reservations/{things['reservation']}/cancel/?force=true")
    assert r.status_code == 401, r.content


@pytest.mark.parametrize("url", ["/api/schema/?format=json", "/api/schema/", "/api/docs/", "/api/redoc/"])
def test_the_schema_and_docs_pages_still_answer(world, url):
    r = world.client("alpha-viewer").get(url)
    assert r.status_code == 200, r.content[:300]
