"""The isolation matrix: every endpoint × (other tenant's lead and viewer, member on a lead's booking, anonymous)."""

from datetime import timedelta

import pytest

from reservations.models import Reservation

from .conftest import iso

pytestmark = pytest.mark.django_db


@pytest.fixture
def booked(world, t0):
    def book(who, offset):
        return world.client(who).post("/api/v1/reservations/", {
            "pool": "h100", "node_count": 2, "start": iso(t0 + timedelta(hours=offset)),
            "end": iso(t0 + timedelta(hours=offset + 2)), "name": f"{who}-secret-run"}, format="json").json()
    return {"alpha": book("alpha-lead", 0), "beta": book("beta-lead", 0)}


def object_urls(world, booked):
    ra = booked["alpha"]
    alpha_node = world.nodes[[n.hostname for n in world.nodes].index(ra["nodes"][0])]
    quota = world.tenants["alpha"].quotas.get()
    return {
        "reservation": f"/api/v1/reservations/{ra['id']}/",
        "cancel": f"/api/v1/reservations/{ra['id']}/cancel/",
        "node": f"/api/v1/nodes/{alpha_node.pk}/",
        "tenant": "/api/v1/tenants/alpha/",
        "quota": f"/api/v1/quotas/{quota.pk}/",
    }


# (endpoint, method, body) × who ⇒ expected status
MATRIX = {
    ("reservation", "get"): {"beta-lead": 404, "beta-viewer": 404, "alpha-member": 200, None: 401},
    ("reservation", "patch"): {"beta-lead": 404, "beta-viewer": 404, "alpha-member": 403, "alpha-viewer": 403,
                               None: 401},
    ("cancel", "post"): {"beta-lead": 404, "beta-viewer": 404, "alpha-member": 403, "alpha-viewer": 403, None: 401},
    ("node", "get"): {"beta-lead": 404, "beta-viewer": 404, "alpha-viewer": 200, None: 401},
    ("node", "patch"): {"beta-lead": 403, "alpha-lead": 403, None: 401},
    ("tenant", "get"): {"beta-lead": 404, "beta-viewer": 404, "alpha-viewer": 200, None: 401},
    ("tenant", "patch"): {"beta-lead": 403, "alpha-lead": 403, None: 401},
    ("quota", "get"): {"beta-lead": 404, "beta-viewer": 404, "alpha-member": 200, None: 401},
    ("quota", "patch"): {"beta-lead": 403, "alpha-lead": 403, None: 401},
}
BODIES = {"patch": {"end": None, "name": "pwned", "state": "failed", "max_nodes": 99}, "post": {}}
CASES = [(ep, method, who, status) for (ep, method), row in MATRIX.items() for who, status in row.items()]
ENVELOPE = {401: "not_authenticated", 403: "permission_denied", 404: "not_found"}


@pytest.mark.parametrize("endpoint,method,who,expected", CASES,
                         ids=[f"{m}-{e}-{w or 'anon'}" for e, m, w, _ in CASES])
def test_object_matrix(world, booked, t0, endpoint, method, who, expected):
    url = object_urls(world, booked)[endpoint]
    body = dict(BODIES.get(method, {}))
    if endpoint == "reservation" and method != "get":  # a GET's data is its query string, which it takes none of
        body = {"end": iso(t0 + timedelta(hours=3)), "name": "pwned"}
    before = Reservation.objects.get(pk=booked["alpha"]["id"])
    r = getattr(world.client(who), method)(url, body, format="json")
    assert r.status_code == expected, r.content
    if expected in ENVELOPE:
        assert r.json()["code"] == ENVELOPE[expected]
        # A refusal never leaks the object: no tenant name, booking name or hostnames in the answer.
        assert b"alpha" not in r.content and b"secret" not in r.content
        after = Reservation.objects.get(pk=booked["alpha"]["id"])
        assert (after.status, after.name, after.period) == (before.status, before.name, before.period)
    if expected == 401:
        assert r["WWW-Authenticate"].startswith("Bearer")


LISTS = ["/api/v1/reservations/", "/api/v1/nodes/", "/api/v1/tenants/", "/api/v1/quotas/",
         "/api/v1/memberships/", "/api/v1/pools/", "/api/v1/availability/?pool=h100"]


@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("who", ["beta-lead", "beta-member", "beta-viewer"])
def test_lists_never_show_another_tenant(world, booked, url, who):
    r = world.client(who).get(url)
    assert r.status_code == 200
    assert b"alpha" not in r.content.lower() and b"secret" not in r.content.replace(b"beta-lead-secret", b"")
    for hostname in booked["alpha"]["nodes"]:
        if url.startswith("/api/v1/nodes/"):
            assert hostname.encode() not in r.content


@pytest.mark.parametrize("url", LISTS + ["/api/v1/reservations/1/", "/api/v1/users/"])
def test_anonymous_gets_401_everywhere(world, url):
    r = world.client(None).get(url)
    assert r.status_code == 401 and r.json()["code"] == "not_authenticated"


def test_bad_token_is_401(world):
    from rest_framework.test import APIClient

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION="Bearer gpp_not-a-real-token")
    r = c.get("/api/v1/reservations/")
    assert r.status_code == 401 and r.json()["code"] == "not_authenticated"


def test_cannot_book_or_add_members_in_a_foreign_tenant(world, booked, t0):
    r = world.client("beta-lead").post("/api/v1/reservations/", {
        "tenant": "alpha", "pool": "h100", "node_count": 1, "start": iso(t0 + timedelta(hours=5)),
        "end": iso(t0 + timedelta(hours=6))}, format="json")
    assert r.status_code == 400 and "tenant" in r.json()["fields"]
    unknown = world.client("beta-lead").post("/api/v1/reservations/", {
        "tenant": "zzz", "pool": "h100", "node_count": 1, "start": iso(t0 + timedelta(hours=5)),
        "end": iso(t0 + timedelta(hours=6))}, format="json")
    # Foreign and nonexistent tenants read the same, so existence is not leaked.
    assert r.json()["fields"]["tenant"].replace("'alpha'", "X") == unknown.json()["fields"]["tenant"].replace(
        "'zzz'", "X")
    r = world.client("beta-lead").post("/api/v1/memberships/", {"tenant": "alpha", "user": "beta-viewer",
                                                                "role": "lead"}, format="json")
    assert r.status_code == 400 and "tenant" in r.json()["fields"]
    r = world.client("beta-member").post("/api/v1/memberships/", {"tenant": "beta", "user": "alpha-viewer",
                                                                  "role": "viewer"}, format="json")
    assert r.status_code == 403


def test_lead_adds_a_member_and_staff_sees_everything(world, booked):
    r = world.client("beta-lead").post("/api/v1/memberships/", {"tenant": "beta", "user": "alpha-viewer",
                                                                "role": "viewer"}, format="json")
    assert r.status_code == 201 and r.json()["tenant"] == "beta"
    staff = world.client("staff")
    assert staff.get("/api/v1/reservations/").json()["count"] == 2
    assert staff.get("/api/v1/tenants/").json()["count"] == 2
    assert staff.get("/api/v1/nodes/").json()["count"] == 4


def test_a_disabled_account_cannot_be_added_by_api(world):
    """The API adds members under the team page's rule: an active account only (found in a review: a lead could make
    a disabled account the tenant's other lead by API, then leave, and no one could manage the tenant)."""
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    gone = get_user_model().objects.create_user(username="gone", password="pw-Long-enough-1", is_active=False)
    for who in ("alpha-lead", "staff"):
        r = world.client(who).post("/api/v1/memberships/", {"tenant": "alpha", "user": "gone", "role": "lead"},
                                   format="json")
        assert r.status_code == 400, r.json()
        assert r.json()["code"] == "invalid" and "user" in r.json()["fields"]
    assert not Membership.objects.filter(user=gone).exists()


def test_staff_only_writes(world):
    for who in ("alpha-lead", "alpha-member"):
        c = world.client(who)
        assert c.post("/api/v1/pools/", {"name": "x", "gpu_model": "x", "gpus_per_node": 1},
                      format="json").status_code == 403
        assert c.post("/api/v1/users/", {"username": "x", "password": "Long-enough-pw-1"},
                      format="json").status_code == 403
        assert c.post("/api/v1/tenants/", {"slug": "x", "name": "x"}, format="json").status_code == 403
    staff = world.client("staff")
    assert staff.post("/api/v1/pools/", {"name": "l40s", "gpu_model": "L40S", "gpus_per_node": 4},
                      format="json").status_code == 201
    r = staff.post("/api/v1/users/", {"username": "newbie", "email": "n@example.com",
                                      "password": "Long-enough-pw-1"}, format="json")
    assert r.status_code == 201 and set(r.json()) == {"id", "username"}


def test_a_tenant_keeps_at_least_one_lead(world):
    """Demoting or removing the last lead is refused (nobody could manage the tenant's members or
    notifications any more); with a second lead it goes through. Staff included."""
    from portal.core.exceptions import InvalidState
    from tenants import services as tsvc
    from tenants.models import Membership

    staff = world.users["staff"]
    lead = Membership.objects.get(tenant__slug="alpha", user__username="alpha-lead")
    with pytest.raises(InvalidState, match="last lead"):
        tsvc.membership_update(actor=staff, membership=lead, role="member")
    with pytest.raises(InvalidState, match="last lead"):
        tsvc.membership_delete(actor=staff, membership=lead)
    assert Membership.objects.filter(pk=lead.pk, role="lead").exists()
    member = Membership.objects.get(tenant__slug="alpha", user__username="alpha-member")
    tsvc.membership_update(actor=staff, membership=member, role="lead")
    tsvc.membership_update(actor=staff, membership=lead, role="viewer")  # another lead remains
    assert Membership.objects.get(pk=lead.pk).role == "viewer"


def test_the_admin_does_not_silently_ignore_a_memberships_changed_user(world):
    from django.test import Client

    from tenants.models import Membership, Tenant

    admin = Client()
    admin.force_login(world.users["staff"].__class__.objects.create_superuser("root3", password="pw-Long-enough-1"))
    tenant = Tenant.objects.get(slug="alpha")
    page = admin.get(f"/admin/tenants/tenant/{tenant.pk}/change/")
    assert page.status_code == 200
    form = page.context["adminform"].form
    data = {k: ("" if v is None else v) for k, v in form.initial.items() if not isinstance(v, list | dict)}
    for formset in page.context["inline_admin_formsets"]:
        fs = formset.formset
        data.update({f"{fs.prefix}-TOTAL_FORMS": str(len(fs.forms)),
                     f"{fs.prefix}-INITIAL_FORMS": str(fs.initial_form_count()),
                     f"{fs.prefix}-MIN_NUM_FORMS": "0", f"{fs.prefix}-MAX_NUM_FORMS": "1000"})
        for sub in fs.forms:
            for name, field in sub.fields.items():
                value = sub.initial.get(name, field.initial)
                data[f"{sub.prefix}-{name}"] = getattr(value, "pk", value) if value is not None else ""
    member = Membership.objects.get(tenant=tenant, user__username="alpha-member")
    key = next(k for k, v in data.items() if k.endswith("-id") and v == member.pk)
    data[key.replace("-id", "-user")] = world.users["beta-lead"].pk
    r = admin.post(f"/admin/tenants/tenant/{tenant.pk}/change/", data, follow=True)
    assert "To give a membership to another user" in r.content.decode()
    assert Membership.objects.get(pk=member.pk).user.username == "alpha-member"


def test_a_stored_node_reason_naming_processes_is_shown_to_a_tenant_without_them(world, booked):
    """Health failure reasons used to name processes ("pids [...]", an XID line's "pid=…, name=…"): another
    team's work on the node. Rows written then still hold them; the node API shows a tenant the reason without
    them, and staff the stored text."""
    from reservations.models import Node

    hostname = booked["alpha"]["nodes"][0]
    node = Node.objects.get(hostname=hostname)
    stored = ("health check failed: GPU 2: stray processes on an idle node: pids [4242, 5353]; "
              "Xid 79 (PCI:0000:1b:00): pid=48213, name=train.py, GPU has fallen off the bus")
    Node.objects.filter(pk=node.pk).update(state_reason=stored)

    for who in ("alpha-lead", "alpha-member"):
        shown = world.client(who).get(f"/api/v1/nodes/{node.pk}/").json()["state_reason"]
        assert shown == ("health check failed: GPU 2: stray processes on an idle node; "
                         "Xid 79 (PCI:0000:1b:00): GPU has fallen off the bus"), shown
        listed = world.client(who).get("/api/v1/nodes/").json()["results"]
        assert [n["state_reason"] for n in listed if n["hostname"] == hostname] == [shown]
    assert world.client("staff").get(f"/api/v1/nodes/{node.pk}/").json()["state_reason"] == stored
    assert Node.objects.get(pk=node.pk).state_reason == stored  # redacted on output only


def test_a_node_reason_carrying_a_credential_is_shown_to_a_tenant_without_it(world, booked):
    """A node's reason may be a tool's or a backend's output (a check's summary): a BMC URL with its password, a
    token. The node API shows a tenant the reason without them (portal.core.redact.without_secrets), staff as stored."""
    from reservations.models import Node

    node = Node.objects.get(hostname=booked["alpha"]["nodes"][0])
    stored = "health check failed: GET https://ops:hunter2@bmc-17.internal/redfish/v1 401 (token=ab12cd34ef56)"
    Node.objects.filter(pk=node.pk).update(state_reason=stored)
    shown = world.client("alpha-member").get(f"/api/v1/nodes/{node.pk}/").json()["state_reason"]
    assert "hunter2" not in shown and "ab12cd34ef56" not in shown, shown
    assert shown.startswith("health check failed: GET https://[redacted]@bmc-17.internal/redfish/v1 401")
    assert world.client("staff").get(f"/api/v1/nodes/{node.pk}/").json()["state_reason"] == stored
