"""Every bad input ⇒ the 400 envelope naming the field, and nothing stored (DESIGN §6)."""

import json
import re
from datetime import timedelta

import pytest

from portal.core.models import AuditLog
from reservations.models import Allocation, IdempotencyKey, Reservation

from .conftest import iso

pytestmark = pytest.mark.django_db


def good(t0):
    return {"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=2))}


CASES = [
    ("naive start", lambda t0: {**good(t0), "start": t0.replace(tzinfo=None).isoformat()}, "start"),
    ("naive end", lambda t0: {**good(t0), "end": (t0 + timedelta(hours=2)).replace(tzinfo=None).isoformat()}, "end"),
    ("end equals start", lambda t0: {**good(t0), "end": iso(t0)}, "end"),
    ("end before start", lambda t0: {**good(t0), "end": iso(t0 - timedelta(hours=1))}, "end"),
    ("misaligned start", lambda t0: {**good(t0), "start": iso(t0 + timedelta(minutes=30))}, "start"),
    ("misaligned end", lambda t0: {**good(t0), "end": iso(t0 + timedelta(minutes=90))}, "end"),
    ("seconds off the grid", lambda t0: {**good(t0), "start": iso(t0 + timedelta(seconds=1))}, "start"),
    ("start in the past", lambda t0: {**good(t0), "start": iso(t0 - timedelta(days=3)),
                                      "end": iso(t0 - timedelta(days=2))}, "start"),
    ("beyond horizon", lambda t0: {**good(t0), "start": iso(t0 + timedelta(days=400)),
                                   "end": iso(t0 + timedelta(days=400, hours=2))}, "end"),
    ("not a date", lambda t0: {**good(t0), "start": "next tuesday"}, "start"),
    ("date as number", lambda t0: {**good(t0), "start": 1767225600}, "start"),
    ("node_count zero", lambda t0: {**good(t0), "node_count": 0}, "node_count"),
    ("node_count negative", lambda t0: {**good(t0), "node_count": -3}, "node_count"),
    ("node_count huge", lambda t0: {**good(t0), "node_count": 10**12}, "node_count"),
    ("node_count over pool size", lambda t0: {**good(t0), "node_count": 5}, "node_count"),
    ("node_count fractional", lambda t0: {**good(t0), "node_count": 1.5}, "node_count"),
    ("node_count float-integral", lambda t0: {**good(t0), "node_count": 2.0}, "node_count"),
    ("node_count string", lambda t0: {**good(t0), "node_count": "2"}, "node_count"),
    ("node_count bool", lambda t0: {**good(t0), "node_count": True}, "node_count"),
    ("node_count missing", lambda t0: {k: v for k, v in good(t0).items() if k != "node_count"}, "node_count"),
    ("node_count null", lambda t0: {**good(t0), "node_count": None}, "node_count"),
    ("start missing", lambda t0: {k: v for k, v in good(t0).items() if k != "start"}, "start"),
    ("start leaves the calendar in UTC", lambda t0: {**good(t0), "start": "0001-01-01T00:00:00+14:00"}, "start"),
    ("end leaves the calendar in UTC", lambda t0: {**good(t0), "end": "9999-12-31T23:59:59-12:00"}, "end"),
    ("start before 1970", lambda t0: {**good(t0), "start": "1969-12-31T23:00:00Z"}, "start"),
    ("NUL after the start", lambda t0: {**good(t0), "start": iso(t0) + "\x00"}, "start"),
    ("NUL inside the end", lambda t0: {**good(t0), "end": iso(t0 + timedelta(hours=2)).replace("Z", "\x00Z")}, "end"),
    ("end in year 9999", lambda t0: {**good(t0), "end": "9999-12-31T23:00:00Z"}, "end"),
    ("unknown pool", lambda t0: {**good(t0), "pool": "tpu-v9"}, "pool"),
    ("foreign tenant", lambda t0: {**good(t0), "tenant": "beta"}, "tenant"),
    ("unknown tenant", lambda t0: {**good(t0), "tenant": "nobody"}, "tenant"),
    ("overlong name", lambda t0: {**good(t0), "name": "x" * 201}, "name"),
    ("NUL in name", lambda t0: {**good(t0), "name": "bad\x00name"}, "name"),
    ("control char in name", lambda t0: {**good(t0), "name": "bell\x07"}, "name"),
    ("name not a string", lambda t0: {**good(t0), "name": ["a"]}, "name"),
    ("unknown orchestrator", lambda t0: {**good(t0), "cluster": {"orchestrator": "nomad"}}, "cluster.orchestrator"),
    ("unknown cuda", lambda t0: {**good(t0), "cluster": {"cuda_version": "9.0"}}, "cluster.cuda_version"),
]


def assert_nothing_stored():
    assert Reservation.objects.count() == 0
    assert Allocation.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0
    assert not AuditLog.objects.filter(action__startswith="reservation").exists()


@pytest.mark.parametrize("label,make,field", CASES, ids=[c[0] for c in CASES])
def test_bad_booking_input(world, t0, label, make, field):
    r = world.client("alpha-lead").post("/api/v1/reservations/", make(t0), format="json",
                                        HTTP_IDEMPOTENCY_KEY=f"bad-{label}")
    assert r.status_code == 400, (label, r.status_code, r.content)
    body = r.json()
    assert body["code"] == "invalid"
    assert field in body["fields"], body
    assert body["detail"]
    assert_nothing_stored()


def test_malformed_json(world):
    r = world.client("alpha-lead").post("/api/v1/reservations/", data=b'{"pool": "h100", ',
                                        content_type="application/json")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and "body" in r.json()["fields"]
    assert_nothing_stored()


@pytest.mark.parametrize("payload", [b"[]", b'"text"', b"42", b"null"])
def test_body_not_an_object(world, payload):
    r = world.client("alpha-lead").post("/api/v1/reservations/", data=payload, content_type="application/json")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and r.json()["fields"], r.content
    assert_nothing_stored()


@pytest.mark.parametrize("ctype,data", [
    ("application/x-www-form-urlencoded", "pool=h100&node_count=1"),
    ("text/plain", "pool=h100"),
    ("multipart/form-data; boundary=x", "--x--"),
])
def test_wrong_content_type(world, ctype, data):
    r = world.client("alpha-lead").post("/api/v1/reservations/", data=data, content_type=ctype)
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid" and "content_type" in r.json()["fields"]
    assert_nothing_stored()


def test_bad_patch_changes_nothing(world, t0):
    rid = world.client("alpha-lead").post("/api/v1/reservations/", good(t0), format="json").json()["id"]
    before = Reservation.objects.get(pk=rid)
    c = world.client("alpha-lead")
    for body, field in [({"end": "soon"}, "end"), ({"end": iso(t0 - timedelta(hours=1))}, "end"),
                        ({"end": iso(t0 + timedelta(minutes=150))}, "end"), ({"name": "x\x00"}, "name"), ({}, "end"),
                        ({"end": "9999-12-31T23:59:59-12:00"}, "end"),
                        ({"start": "0001-01-01T00:00:00+14:00"}, "start"),
                        # What a booking fixes is refused by name, not dropped while the rest applies.
                        ({"end": iso(t0 + timedelta(hours=4)), "node_count": 8}, "node_count"),
                        ({"name": "renamed", "pool": "other"}, "pool"), ({"status": "cancelled"}, "status"),
                        ({"end": iso(t0 + timedelta(hours=4)), "tenant": "beta"}, "tenant"),
                        ({"name": "renamed", "cluster": {"orchestrator": "kubernetes"}}, "cluster")]:
        r = c.patch(f"/api/v1/reservations/{rid}/", body, format="json")
        assert r.status_code == 400 and field in r.json()["fields"], (body, r.json())
    after = Reservation.objects.get(pk=rid)
    assert (after.period, after.name, after.updated_at) == (before.period, before.name, before.updated_at)


@pytest.mark.parametrize("make,field", [
    (lambda t0: {"node_cont": 5}, "node_cont"),
    (lambda t0: {"end": iso(t0 + timedelta(hours=4)), "node_cont": 5}, "node_cont"),
    (lambda t0: {"name": "renamed", "nmae": "typo"}, "nmae"),
    (lambda t0: {"start": iso(t0 + timedelta(hours=1)), "end": iso(t0 + timedelta(hours=3)),
                 "nodes": ["h100-001"]}, "nodes"),
], ids=["typo alone", "typo beside an end", "typo beside a name", "read-only field beside a move"])
def test_a_patch_naming_an_unknown_field_is_refused_and_changes_nothing(world, t0, make, field):
    # A typo in a PATCH is answered 400 naming the field (as the cluster spec PATCH does), never 200
    # with the known fields applied and the misspelt one dropped: the caller would believe it applied.
    rid = world.client("alpha-lead").post("/api/v1/reservations/", good(t0), format="json").json()["id"]
    before = Reservation.objects.get(pk=rid)
    body = make(t0)
    r = world.client("alpha-lead").patch(f"/api/v1/reservations/{rid}/", body, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid" and field in r.json()["fields"], r.json()
    assert field in r.json()["detail"], r.json()
    after = Reservation.objects.get(pk=rid)
    assert (after.period, after.name, after.updated_at) == (before.period, before.name, before.updated_at)
    assert not AuditLog.objects.filter(action="reservation.update").exists()


@pytest.mark.parametrize("params,field", [
    ({}, "pool"),
    ({"pool": "nope"}, "pool"),
    ({"pool": "h100", "start": "2026-01-01T00:00:00"}, "start"),
    ({"pool": "h100", "step": "90"}, "step"),
    ({"pool": "h100", "step": "5400"}, "step"),
    ({"pool": "h100", "step": "abc"}, "step"),
    ({"pool": "h100", "start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"}, "end"),
    ({"pool": "h100", "start": "2026-01-01T00:00:00Z", "end": "2027-01-01T00:00:00Z"}, "step"),
    # Found by fuzzing (schemathesis): each of these was a 500 (an overflow in Python or PostgreSQL).
    ({"pool": "h100", "step": "100000000000000"}, "step"),
    ({"pool": "h100", "step": "86400000000000"}, "step"),
    ({"pool": "h100", "step": "86399999996400"}, "step"),
    ({"pool": "h100", "start": "9999-12-31T23:00:00Z"}, "start"),
    ({"pool": "h100", "start": "0001-01-01T00:00:00+14:00"}, "start"),
    ({"pool": "h100", "end": "9999-12-31T23:59:59-12:00"}, "end"),
    ({"pool": "h100", "start": "0999-06-01T00:00:00Z", "end": "0999-06-01T02:00:00Z"}, "start"),
])
def test_bad_availability_query(world, params, field):
    r = world.client("alpha-viewer").get("/api/v1/availability/", params)
    assert r.status_code == 400 and r.json()["code"] == "invalid" and field in r.json()["fields"], r.json()


@pytest.mark.parametrize("url,body,field", [
    ("/api/v1/pools/", {"name": "Bad Name", "gpu_model": "x", "gpus_per_node": 8}, "name"),
    ("/api/v1/pools/", {"name": "ok", "gpu_model": "x", "gpus_per_node": 0}, "gpus_per_node"),
    ("/api/v1/pools/", {"name": "h100", "gpu_model": "x", "gpus_per_node": 8}, "name"),
    ("/api/v1/nodes/", {"hostname": "n1", "pool": "nope"}, "pool"),
    ("/api/v1/nodes/", {"hostname": "h100-001", "pool": "h100"}, "hostname"),
    ("/api/v1/quotas/", {"tenant": "alpha", "pool": "h100", "max_nodes": 1}, "pool"),
    ("/api/v1/quotas/", {"tenant": "alpha", "pool": "h100", "max_nodes": -1}, "max_nodes"),
    ("/api/v1/tenants/", {"slug": "alpha", "name": "dup"}, "slug"),
    ("/api/v1/tenants/", {"slug": "UPPER", "name": "x"}, "slug"),
    ("/api/v1/tenants/", {"slug": "net", "name": "x", "cidr": "10.0.0.0/33"}, "cidr"),
    # Python's ipaddress takes an IPv6 scope (zone) id; PostgreSQL's inet does not (was: 500, DataError).
    ("/api/v1/tenants/", {"slug": "net", "name": "x", "cidr": "fe80::%eth0/64"}, "cidr"),
    ("/api/v1/tenants/", {"slug": "net", "name": "x", "cidr": "fe80::%1/128"}, "cidr"),
    ("/api/v1/users/", {"username": "alpha-lead", "password": "Another-long-pw-9"}, "username"),
    ("/api/v1/users/", {"username": "newbie", "password": "123"}, "password"),
    ("/api/v1/memberships/", {"tenant": "alpha", "user": "ghost", "role": "lead"}, "user"),
    ("/api/v1/memberships/", {"tenant": "alpha", "user": "beta-lead", "role": "king"}, "role"),
    ("/api/v1/memberships/", {"tenant": "alpha", "user": "alpha-lead", "role": "member"}, "user"),
])
def test_bad_staff_writes(world, url, body, field):
    from django.contrib.auth import get_user_model

    from reservations.models import Node, Pool
    from tenants.models import Membership, Quota, Tenant

    counts = [m.objects.count() for m in (Pool, Node, Quota, Tenant, Membership, get_user_model())]
    r = world.client("staff").post(url, body, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and field in r.json()["fields"], r.json()
    assert counts == [m.objects.count() for m in (Pool, Node, Quota, Tenant, Membership, get_user_model())]


@pytest.mark.parametrize("url,body,field", [
    ("quota", {"max_node": 0}, "max_node"),
    ("quota", {"burst_nodes": 2, "max_node": 0}, "max_node"),
    ("node", {"stat": "draining"}, "stat"),
    ("node", {"state_reason": "vendor", "pool": "other"}, "pool"),
    ("tenant", {"burst_enable": False}, "burst_enable"),
    ("tenant", {"name": "Alpha Team", "vlan": 7}, "vlan"),
])
def test_a_staff_patch_naming_an_unknown_field_is_refused_and_changes_nothing(world, url, body, field):
    # As the reservation and cluster PATCHes: a typo is a 400 naming it, not a 200 with it dropped (a staff
    # script cutting a quota with {"max_node": 0} was told it worked, and an audit row said so).
    from reservations.models import Node
    from tenants.models import Quota, Tenant

    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    path = {"quota": f"/api/v1/quotas/{quota.pk}/", "node": f"/api/v1/nodes/{world.nodes[0].pk}/",
            "tenant": "/api/v1/tenants/alpha/"}[url]

    def state():
        return (list(Quota.objects.order_by("pk").values()), list(Node.objects.order_by("pk").values()),
                list(Tenant.objects.order_by("pk").values()), AuditLog.objects.count())

    before = state()
    r = world.client("staff").patch(path, body, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid" and field in r.json()["fields"] and field in r.json()["detail"], r.json()
    assert state() == before


@pytest.mark.parametrize("cidr", ["fe80::%eth0/64", "fe80::%1/128"])
def test_a_scoped_ipv6_network_is_refused_on_a_tenant_change(world, cidr):
    from tenants.models import Tenant

    r = world.client("staff").patch("/api/v1/tenants/alpha/", {"cidr": cidr}, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and "cidr" in r.json()["fields"], r.content
    assert Tenant.objects.get(slug="alpha").cidr == ""
    assert not AuditLog.objects.filter(action="tenant.update").exists()


def test_overlapping_tenant_networks_are_refused_by_the_database(world):
    c = world.client("staff")
    assert c.post("/api/v1/tenants/", {"slug": "n1", "name": "n1", "cidr": "10.8.0.0/16", "vlan_id": 100},
                  format="json").status_code == 201
    r = c.post("/api/v1/tenants/", {"slug": "n2", "name": "n2", "cidr": "10.8.4.0/24"}, format="json")
    assert r.status_code == 400 and "cidr" in r.json()["fields"]
    r = c.post("/api/v1/tenants/", {"slug": "n3", "name": "n3", "vlan_id": 100}, format="json")
    assert r.status_code == 400 and "vlan_id" in r.json()["fields"]


# NUL (0x00): PostgreSQL text cannot hold one and psycopg refuses to send it, so wherever a NUL could
# reach a lookup it must be a 400 naming where it was — never the database error's 500.
NUL_BODIES = [
    ("/api/v1/reservations/", "alpha-lead", lambda t0: {**good(t0), "tenant": "al\x00pha"}, "tenant"),
    ("/api/v1/reservations/", "alpha-lead", lambda t0: {**good(t0), "pool": "h1\x0000"}, "pool"),
    ("/api/v1/nodes/", "staff", lambda t0: {"hostname": "n9", "pool": "\x00"}, "pool"),
    ("/api/v1/quotas/", "staff", lambda t0: {"tenant": "\x00", "pool": "h100", "max_nodes": 1}, "tenant"),
    ("/api/v1/quotas/", "staff", lambda t0: {"tenant": "alpha", "pool": "h100\x00", "max_nodes": 1}, "pool"),
    ("/api/v1/memberships/", "staff", lambda t0: {"tenant": "alpha", "user": "be\x00ta", "role": "member"}, "user"),
    ("/api/v1/memberships/", "alpha-lead", lambda t0: {"tenant": "\x00alpha", "user": "beta-lead", "role": "member"},
     "tenant"),
]


@pytest.mark.parametrize("url,who,make,field", NUL_BODIES, ids=[f"{b[0]}-{b[3]}" for b in NUL_BODIES])
def test_nul_in_a_slug_of_a_json_body(world, t0, url, who, make, field):
    from django.contrib.auth import get_user_model

    from reservations.models import Node
    from tenants.models import Membership, Quota

    models = (Reservation, Node, Quota, Membership, get_user_model())
    counts = [m.objects.count() for m in models]
    r = world.client(who).post(url, make(t0), format="json")
    assert r.status_code == 400, (r.status_code, r.content)
    assert r.json()["code"] == "invalid" and field in r.json()["fields"], r.json()
    assert counts == [m.objects.count() for m in models]


def _routes():
    """Every URL pattern of the site but the admin's, as (route, has a string parameter)."""
    from django.urls import URLResolver, get_resolver

    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                if str(p.pattern) != "admin/":
                    yield from walk(p.url_patterns, prefix + str(p.pattern))
            else:
                yield prefix + str(p.pattern)
    return list(walk(get_resolver().url_patterns))


def _fill(route: str, text: str) -> str:
    """A concrete path for route: integer parameters 1, every other parameter text."""
    import re

    path = route.replace("^", "").replace("$", "")
    path = re.sub(r"<int:\w+>", "1", path)
    path = re.sub(r"<(?:str|slug|path):\w+>", text, path)
    path = re.sub(r"\(\?P<kind>[^)]*\)", "kubeconfig", path)
    path = re.sub(r"\(\?P<pk>[^)]*\)", "1", path)
    path = re.sub(r"\(\?P<\w+>[^)]*\)", text, path)
    return "/" + path.replace("\\.", ".").replace("(?P<format>[a-z0-9]+)", "json")


def test_nul_in_a_url_or_query_is_a_400_on_every_route(world):
    from django.test import Client

    web = Client(raise_request_exception=False)
    web.force_login(world.users["staff"])
    api = world.client("staff")
    api.raise_request_exception = False
    routes = [r for r in _routes() if "format" not in r]
    with_text = [r for r in routes if re.search(r"<(?:str|slug|path):|\(\?P<(?!pk>|kind>)", r)]
    assert len(routes) > 40 and {"api/v1/^tenants/(?P<slug>[^/]+)/$", "health/nodes/<str:hostname>/"} <= set(with_text)
    seen = []
    for route in routes:
        client = api if route.startswith("api/") else web
        for path in {_fill(route, "x"), _fill(route, "%00")}:
            for url in ([f"{path}?pool=%00"] + ([path] if "%00" in path else [])):
                r = client.get(url)
                seen.append((url, r.status_code))
                assert r.status_code == 400, (url, r.status_code, r.content[:200])
                if url.startswith("/api/"):
                    assert r.json()["code"] == "invalid" and r.json()["fields"], r.json()
    assert len(seen) > len(routes)


def test_nul_in_a_form_field_is_a_400(world):
    from django.test import Client

    web = Client(raise_request_exception=False)
    web.force_login(world.users["alpha-lead"])
    # Refused at the door, before any form (the switcher, the booking form) sees the field.
    r = web.post("/tenant/switch/", {"tenant": "al\x00pha", "next": "/"})
    assert r.status_code == 400 and b"tenant" in r.content, (r.status_code, r.content[:200])
    r = web.post("/reservations/new/", {"pool": "h1\x0000", "node_count": "1", "start": "2030-01-01T00:00",
                                        "end": "2030-01-01T02:00"})
    assert r.status_code == 400 and b"pool" in r.content
    assert_nothing_stored()


def test_a_cookie_with_nul_is_dropped_not_a_500(world):
    """A session or CSRF cookie with a NUL reached the session lookup (a 500 on every page, signed in or
    not); it is dropped, and the request goes on as an anonymous one."""
    from django.test import Client

    web = Client(raise_request_exception=False)
    web.cookies["sessionid"] = "abcdefgh\x00ijkl"
    web.cookies["csrftoken"] = "x\x00y"
    r = web.get("/")
    assert r.status_code in (200, 302), (r.status_code, r.content[:200])
    assert web.get("/accounts/login/").status_code == 200
    api = world.client("alpha-viewer")
    api.raise_request_exception = False
    api.cookies["sessionid"] = "\x00"
    assert api.get("/api/v1/reservations/").status_code == 200  # the token still signs it in


@pytest.mark.parametrize("params", [{"start": "0001-01-01T00:00:00+14:00"}, {"end": "9999-12-31T23:59:59-12:00"},
                                    {"start": "9999-12-31T23:00:00Z"}])
def test_bad_reservation_list_window(world, params):
    r = world.client("alpha-viewer").get("/api/v1/reservations/", params)
    assert r.status_code == 400 and r.json()["code"] == "invalid" and set(params) <= set(r.json()["fields"]), r.json()


def test_out_of_range_dates_in_the_browser_pages_are_refused_not_a_500(world):
    from django.test import Client

    web = Client(raise_request_exception=False)
    web.force_login(world.users["staff"])
    for url in ["/calendar/events.json?start=9999-12-31T00:00:00Z&end=9999-12-31T23:00:00Z",
                "/calendar/availability.json?pool=h100&start=0001-01-01T00:00:00%2B14:00&end=2030-01-01T00:00:00Z",
                "/calendar/events.json?start=9999-12-30T00:00&end=9999-12-31T00:00"]:
        r = web.get(url)
        assert r.status_code == 400, (url, r.status_code, r.content[:200])
    r = web.get("/fleet/?start=9999-12-31&days=14")
    assert r.status_code == 200  # an unusable window is ignored for the default one, as a malformed one is
    r = web.post("/reservations/new/", {"pool": "h100", "node_count": "1", "start": "9999-12-31T22:00",
                                        "end": "9999-12-31T23:00"})
    assert r.status_code in (200, 400) and b"1970" in r.content
    assert_nothing_stored()


def test_utc_output_zero_pads_the_year():
    from datetime import UTC, datetime

    from portal.core.fields import AwareDateTimeField

    assert AwareDateTimeField().to_representation(datetime(999, 6, 1, tzinfo=UTC)) == "0999-06-01T00:00:00Z"
    assert AwareDateTimeField().to_representation(datetime(2026, 1, 5, 9, tzinfo=UTC)) == "2026-01-05T09:00:00Z"


@pytest.mark.parametrize("url,who", [("/api/v1/pools/", "staff"), ("/api/v1/tenants/", "staff"),
                                     ("/api/v1/memberships/", "alpha-lead"), ("/api/v1/reservations/", "alpha-lead")])
@pytest.mark.parametrize("depth", [40, 900, 1000, 100_000])
def test_deeply_nested_json_is_a_400_not_a_500(world, t0, url, who, depth):
    # Python's JSON decoder (and encoder) recurse: a small body nested deep enough raised RecursionError,
    # which DRF's parser does not catch (a 500). An unknown field nested just short of the limit got past
    # the parser and then into the Idempotency-Key's fingerprint (json.dumps), another 500.
    from django.contrib.auth import get_user_model

    from reservations.models import Node, Pool
    from tenants.models import Membership, Quota, Tenant

    models = (Pool, Node, Quota, Tenant, Membership, get_user_model(), Reservation)
    counts = [m.objects.count() for m in models]
    junk = "[" * depth + "]" * depth
    body = '{"slug": "deep", "name": "Deep", "gpu_model": "x", "gpus_per_node": 8, "name": "deep", ' \
           '"tenant": "alpha", "user": "beta-lead", "role": "member", ' \
           f'"pool": "h100", "node_count": 1, "start": "{iso(t0)}", "end": "{iso(t0 + timedelta(hours=2))}", ' \
           f'"junk": {junk}}}'
    client = world.client(who)
    client.raise_request_exception = False
    r = client.generic("POST", url, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="deep-1")
    assert r.status_code == 400, (r.status_code, r.content[:200])
    assert r.json()["code"] == "invalid" and "body" in r.json()["fields"], r.json()
    assert counts == [m.objects.count() for m in models]


def test_the_json_depth_limit_is_far_above_any_real_body():
    import io

    from rest_framework.exceptions import ParseError

    from portal.core.drf import MAX_JSON_DEPTH, JSONParser

    def parse(depth):
        return JSONParser().parse(io.BytesIO(("[" * depth + "]" * depth).encode()))

    assert parse(MAX_JSON_DEPTH) is not None
    with pytest.raises(ParseError):
        parse(MAX_JSON_DEPTH + 1)


@pytest.mark.parametrize("url,who", [("/api/v1/tenants/", "staff"), ("/api/v1/reservations/", "alpha-lead")])
def test_a_body_over_the_size_limit_is_refused_unparsed(world, t0, url, who, settings):
    """The parser bounds the body (PORTAL_API_MAX_BODY_BYTES), below Django's DATA_UPLOAD_MAX_MEMORY_SIZE."""
    from tenants.models import Tenant

    settings.PORTAL_API_MAX_BODY_BYTES = 4096
    counts = (Tenant.objects.count(), Reservation.objects.count())
    padding = "x" * 5000
    body = json.dumps({"slug": "big", "name": padding, "pool": "h100", "node_count": 1, "start": iso(t0),
                       "end": iso(t0 + timedelta(hours=2))})
    r = world.client(who).generic("POST", url, body, content_type="application/json")
    assert r.status_code == 400, r.content[:200]
    assert r.json()["code"] == "invalid" and "larger than 4096 bytes" in r.json()["fields"]["body"]
    assert counts == (Tenant.objects.count(), Reservation.objects.count())
    # Just under the limit parses as usual (and is judged on its content).
    small = json.dumps({"pool": "h100", "node_count": 1, "start": iso(t0), "end": iso(t0 + timedelta(hours=2)),
                        "name": "y" * 100})
    assert world.client("alpha-lead").generic("POST", "/api/v1/reservations/", small,
                                              content_type="application/json").status_code == 201


@pytest.mark.parametrize("api_limit,django_limit,limit", [(4096, 8192, 4096), (16384, 8192, 8192)])
def test_a_body_over_djangos_upload_limit_is_the_same_envelope(world, t0, settings, api_limit, django_limit, limit):
    """DRF hands a JSON parser request.body, which Django refuses past DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB by
    default) before the parser's own bound is reached: that RequestDataTooBig was Django's HTML 400 page (since
    handler400, a bare "request" envelope), not the parser's answer naming the body and the limit."""
    settings.PORTAL_API_MAX_BODY_BYTES = api_limit
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = django_limit
    count = Reservation.objects.count()
    body = json.dumps({**good(t0), "name": "x" * 10_000})
    r = world.client("alpha-lead").generic("POST", "/api/v1/reservations/", body, content_type="application/json")
    assert r.status_code == 400 and r["Content-Type"] == "application/json", r.content[:200]
    assert r.json()["code"] == "invalid" and set(r.json()["fields"]) == {"body"}, r.json()
    assert f"larger than {limit} bytes" in r.json()["fields"]["body"]
    assert Reservation.objects.count() == count


def test_an_unknown_format_parameter_is_a_400_not_a_404(world, t0):
    """?format= names a renderer; one the API does not have is malformed input, not an unknown object."""
    lead = world.client("alpha-lead")
    booked = lead.post("/api/v1/reservations/", good(t0), format="json").json()["id"]
    for url in (f"/api/v1/reservations/{booked}/?format=xml", "/api/v1/reservations/?format=api",
                "/api/v1/availability/?pool=h100&format=csv"):
        r = lead.get(url)
        # was: 404 not_found, "Not found." — for the caller's own reservation
        assert r.status_code == 400, (url, r.status_code, r.content[:200])
        assert r.json()["code"] == "invalid" and set(r.json()["fields"]) == {"format"}, r.json()
    r = lead.post("/api/v1/reservations/?format=xml", good(t0 + timedelta(hours=4)), format="json")
    assert r.status_code == 400 and set(r.json()["fields"]) == {"format"}, r.json()
    assert Reservation.objects.count() == 1
    assert lead.get(f"/api/v1/reservations/{booked}/?format=json").status_code == 200


def test_nul_in_the_idempotency_key_header_is_a_400(world, t0):
    """The key is stored as text (PostgreSQL refuses NUL): a server that passes such a header on (the
    development server does; gunicorn refuses it itself) must not turn it into a 500."""
    client = world.client("alpha-lead")
    client.raise_request_exception = False
    r = client.post("/api/v1/reservations/", good(t0), format="json", HTTP_IDEMPOTENCY_KEY="retry\x001")
    # was: 500 (DataError: PostgreSQL text fields cannot contain NUL (0x00) bytes)
    assert r.status_code == 400, (r.status_code, r.content[:200])
    assert r.json()["code"] == "invalid" and set(r.json()["fields"]) == {"Idempotency-Key"}, r.json()
    assert_nothing_stored()
    bearer = world.client(None)
    bearer.raise_request_exception = False
    bearer.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens['alpha-lead']}\x00")
    assert bearer.get("/api/v1/reservations/").status_code == 401


@pytest.mark.parametrize("method,url,body,field,noun", [
    ("get", "/api/v1/availability/", {"pool": "zzz"}, "pool", "pool"),
    ("post", "/api/v1/quotas/", {"tenant": "zzz", "pool": "h100", "max_nodes": 1}, "tenant", "tenant"),
    ("post", "/api/v1/quotas/", {"tenant": "alpha", "pool": "zzz", "max_nodes": 1}, "pool", "pool"),
    ("post", "/api/v1/nodes/", {"hostname": "n9", "pool": "zzz"}, "pool", "pool"),
    ("post", "/api/v1/memberships/", {"tenant": "alpha", "user": "zzz", "role": "member"}, "user", "user"),
    ("post", "/api/v1/reservations/", None, "pool", "pool"),  # the wording the others now share
])
def test_an_unknown_slug_is_named_in_the_projects_wording_everywhere(world, t0, method, url, body, field, noun):
    # Availability, quotas, nodes and memberships answered DRF's "Object with name=zzz does not exist."
    # where the reservation endpoints say "Unknown pool 'zzz'.": one wording, in the field it names.
    from reservations.models import Node
    from tenants.models import Membership, Quota

    if body is None:
        body = {"tenant": "alpha", "pool": "zzz", "node_count": 1, "start": iso(t0),
                "end": iso(t0 + timedelta(hours=1))}
    who = "alpha-lead" if url == "/api/v1/reservations/" else "staff"
    before = [m.objects.count() for m in (Node, Quota, Membership, Reservation)]
    client = world.client(who)
    r = client.get(url, body) if method == "get" else client.post(url, body, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid", r.content
    assert r.json()["fields"] == {field: f"Unknown {noun} 'zzz'."}, r.json()
    assert f"Unknown {noun} 'zzz'." in r.json()["detail"], r.json()
    assert before == [m.objects.count() for m in (Node, Quota, Membership, Reservation)]


@pytest.mark.parametrize("value", ["yes", "on", "true", "True", "1", 1, 0, "false", "off", "no", 1.0])
def test_a_boolean_in_a_body_is_json_true_or_false_only(world, value):
    # burst_enabled took DRF's loose booleans ("yes", "on", 1, "0", …) where integer fields are strict: a
    # script sending "false" as a string got whatever DRF made of it. Anything but true/false is a 400
    # naming the field, and nothing changes.
    from tenants.models import Tenant

    def state():
        return list(Tenant.objects.order_by("pk").values()), AuditLog.objects.count()

    before = state()
    client = world.client("staff")
    for r in (client.post("/api/v1/tenants/", {"slug": "newt", "name": "New", "burst_enabled": value},
                          format="json"),
              client.patch("/api/v1/tenants/alpha/", {"burst_enabled": value}, format="json")):
        assert r.status_code == 400 and r.json()["code"] == "invalid", r.content
        assert set(r.json()["fields"]) == {"burst_enabled"}, r.json()
        assert r.json()["fields"]["burst_enabled"] == "Must be true or false (a JSON boolean).", r.json()
    assert state() == before
    r = client.patch("/api/v1/tenants/alpha/", {"burst_enabled": False}, format="json")
    assert r.status_code == 200 and r.json()["burst_enabled"] is False, r.content


def test_an_offset_plus_sent_unencoded_in_a_query_string_is_a_400_that_says_to_encode_it(world, t0):
    # "+02:00" in a query string arrives as " 02:00" (a "+" there means a space): the 400 only said "Not an
    # ISO 8601 datetime.", which the value the caller typed plainly is. It now says the "+" must be %2B.
    # The server does not take the space for a "+": DESIGN §6 takes ISO 8601 with an offset, and one spelling.
    from urllib.parse import quote

    local = (t0 + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%S")
    client = world.client("alpha-viewer")
    r = client.get(f"/api/v1/availability/?pool=h100&start={local}+02:00")
    assert r.status_code == 400 and r.json()["code"] == "invalid", r.content
    assert "%2B" in r.json()["fields"]["start"] and "arrived as a space" in r.json()["fields"]["start"], r.json()
    r = client.get(f"/api/v1/availability/?pool=h100&start={quote(local + '+02:00')}")
    assert r.status_code == 200 and r.json()["slots"][0]["start"] == iso(t0), r.json()
    r = client.get("/api/v1/availability/", {"pool": "h100", "start": "yesterday"})
    assert r.json()["fields"]["start"] == "Not an ISO 8601 datetime.", r.json()  # no hint where it does not apply
