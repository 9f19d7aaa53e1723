"""The staff-only writes of DESIGN §6 (tenants, users, pools, nodes, quotas) take what they document."""

import pytest

from portal.core.models import AuditLog
from tenants.models import Tenant

pytestmark = pytest.mark.django_db


def test_a_tenant_created_with_a_slack_url_keeps_it_masked_in_the_audit(world):
    url = "https://93.184.216.34/services/T0/B0/secret-part"
    r = world.client("staff").post("/api/v1/tenants/", {"slug": "gamma", "name": "Gamma", "slack_webhook_url": url},
                                   format="json")
    assert r.status_code == 201, r.json()
    assert "slack_webhook_url" not in r.json()  # write-only
    assert Tenant.objects.get(slug="gamma").slack_webhook_url == url
    entry = AuditLog.objects.get(action="tenant.create")
    assert "secret-part" not in str(entry.after) and entry.after["slack_webhook_url"].endswith("t-part")


def test_a_tenant_created_with_a_private_slack_url_is_refused_and_not_stored(world, settings):
    settings.PORTAL_WEBHOOK_ALLOW_PRIVATE = False
    r = world.client("staff").post("/api/v1/tenants/", {"slug": "gamma", "name": "Gamma",
                                                        "slack_webhook_url": "http://169.254.169.254/latest/"},
                                   format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid", r.json()
    assert "slack_webhook_url" in r.json()["fields"]
    assert not Tenant.objects.filter(slug="gamma").exists()
    assert not AuditLog.objects.filter(action="tenant.create").exists()


def _long_slack_url(length: int) -> str:
    base = "https://93.184.216.34/services/T0/B0/"
    return base + "x" * (length - len(base))


@pytest.mark.parametrize("method", ["post", "patch"])
def test_a_slack_url_as_long_as_the_portal_stores_is_accepted_through_the_api(world, method):
    """The API capped the Slack URL at 500 characters while the tenant form, the notifications page and the
    egress check (what the model stores) take 2000: staff could save through the admin a URL the API refused."""
    url = _long_slack_url(2000)
    staff = world.client("staff")
    if method == "post":
        r = staff.post("/api/v1/tenants/", {"slug": "gamma", "name": "Gamma", "slack_webhook_url": url}, format="json")
        assert r.status_code == 201, r.json()
        assert Tenant.objects.get(slug="gamma").slack_webhook_url == url
    else:
        r = staff.patch("/api/v1/tenants/alpha/", {"slack_webhook_url": url}, format="json")
        assert r.status_code == 200, r.json()
        assert Tenant.objects.get(slug="alpha").slack_webhook_url == url


@pytest.mark.parametrize("method", ["post", "patch"])
def test_a_slack_url_longer_than_the_portal_stores_is_refused_naming_the_field(world, method):
    staff = world.client("staff")
    kept = "https://93.184.216.34/services/T0/B0/kept"
    assert staff.patch("/api/v1/tenants/alpha/", {"slack_webhook_url": kept}, format="json").status_code == 200
    audits, name = AuditLog.objects.count(), Tenant.objects.get(slug="alpha").name
    too_long = _long_slack_url(2001)
    if method == "post":
        r = staff.post("/api/v1/tenants/", {"slug": "gamma", "name": "Gamma", "slack_webhook_url": too_long},
                       format="json")
    else:
        r = staff.patch("/api/v1/tenants/alpha/", {"slack_webhook_url": too_long, "name": "Renamed"}, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid", r.json()
    assert list(r.json()["fields"]) == ["slack_webhook_url"]
    assert not Tenant.objects.filter(slug="gamma").exists()
    alpha = Tenant.objects.get(slug="alpha")
    assert (alpha.slack_webhook_url, alpha.name) == (kept, name)  # nothing of the request stored
    assert AuditLog.objects.count() == audits


@pytest.mark.parametrize("url", ["/api/v1/tenants/", "/api/v1/memberships/", "/api/v1/pools/", "/api/v1/nodes/",
                                 "/api/v1/quotas/", "/api/v1/clusters/", "/api/v1/health-checks/"])
@pytest.mark.parametrize("page", ["abc", "0", "-1", "1.5", ""])
def test_a_malformed_page_number_is_a_400_naming_page_not_a_404(world, url, page):
    # 404 says "unknown or another tenant's object" (DESIGN §6) (and, as the schema says, a page past the
    # end of the list); a page number that is no whole number of 1 or more is malformed input.
    r = world.client("staff").get(url, {"page": page})
    assert r.status_code == 400, (r.status_code, r.json())
    assert r.json()["code"] == "invalid" and "page" in r.json()["fields"], r.json()


def test_the_last_page_and_the_first_page_of_an_empty_list_are_fine(world):
    c = world.client("staff")
    assert c.get("/api/v1/nodes/", {"page": 1, "page_size": 3}).json()["next"].endswith("page=2&page_size=3")
    r = c.get("/api/v1/nodes/", {"page": 2, "page_size": 3})
    assert r.status_code == 200 and len(r.json()["results"]) == 1 and r.json()["next"] is None
    r = c.get("/api/v1/clusters/", {"page": 1})
    assert r.status_code == 200 and r.json() == {"count": 0, "next": None, "previous": None, "results": []}
    assert c.get("/api/v1/nodes/", {"page": "last", "page_size": 3}).json()["results"][0]["hostname"] == "h100-004"
    r = c.get("/api/v1/nodes/", {"page": 3, "page_size": 3})
    assert r.status_code == 404 and r.json()["code"] == "not_found"  # past the end, as the schema documents


def test_a_username_differing_only_in_case_is_refused_as_the_admin_refuses_it(world):
    from django.contrib.auth import get_user_model

    users = get_user_model().objects.count()
    r = world.client("staff").post("/api/v1/users/", {"username": "ALPHA-Lead", "password": "A-long-enough-pw-7"},
                                   format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid" and "username" in r.json()["fields"], r.json()
    assert get_user_model().objects.count() == users
    assert not AuditLog.objects.filter(action="user.create").exists()


def test_a_hostname_differing_only_in_case_is_refused(world):
    """H100-001 and h100-001 are one host in DNS terms (and to Slurm's and Kubernetes' node lookups); the API
    took the second as a new node, so the one machine could be booked twice over."""
    from reservations.models import Node

    existing = Node.objects.order_by("hostname").first().hostname
    nodes = Node.objects.count()
    r = world.client("staff").post("/api/v1/nodes/", {"hostname": existing.upper(), "pool": "h100"}, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid", r.json()
    assert list(r.json()["fields"]) == ["hostname"], r.json()
    assert Node.objects.count() == nodes
    assert not AuditLog.objects.filter(action="node.create").exists()


@pytest.mark.parametrize("body", [{}, {"max_nodes": 3, "burst_nodes": 1}, {"max_duration_hours": None}])
def test_a_quota_patch_that_changes_nothing_records_no_change(world, body):
    """A PATCH giving no field, or the values the quota already has, changed nothing: it was audited as a
    "Quota changed" with no before → after (on the tenant's audit page too) and moved the quota's version, so
    an admin's open quota form was refused as stale although nothing had changed."""
    from tenants.selectors import quota_version

    quota = world.tenants["alpha"].quotas.get()
    version = quota_version(quota)
    r = world.client("staff").patch(f"/api/v1/quotas/{quota.pk}/", body, format="json")
    assert r.status_code == 200, r.json()
    assert (r.json()["max_nodes"], r.json()["burst_nodes"], r.json()["max_duration_hours"]) == (3, 1, None)
    quota.refresh_from_db()
    assert quota_version(quota) == version
    assert not AuditLog.objects.filter(action="quota.update").exists()
    assert not quota.history.filter(history_type="~").exists()
    # A real change is still made and audited once.
    assert world.client("staff").patch(f"/api/v1/quotas/{quota.pk}/", {"max_nodes": 4}, format="json").json()[
        "max_nodes"] == 4
    assert AuditLog.objects.filter(action="quota.update").count() == 1


@pytest.mark.parametrize("body", [{}, {"name": "Team Alpha", "burst_enabled": True}])
def test_a_tenant_patch_that_changes_nothing_records_no_change(world, body):
    r = world.client("staff").patch("/api/v1/tenants/alpha/", body, format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["name"] == "Team Alpha"
    assert not AuditLog.objects.filter(action="tenant.update").exists()
    assert world.client("staff").patch("/api/v1/tenants/alpha/", {"name": "Alpha"}, format="json").status_code == 200
    (entry,) = AuditLog.objects.filter(action="tenant.update")
    assert (entry.before["name"], entry.after["name"]) == ("Team Alpha", "Alpha")


@pytest.mark.parametrize("url", ["/api/v1/tenants/", "/api/v1/pools/", "/api/v1/nodes/", "/api/v1/reservations/",
                                 "/api/v1/clusters/", "/api/v1/health-checks/"])
@pytest.mark.parametrize("size", ["abc", "0", "-1", "1.5", "", "501"])
def test_a_malformed_or_out_of_range_page_size_is_a_400_naming_page_size(world, url, size):
    # DESIGN §6: malformed or out-of-range input is 400 invalid naming the field. DRF ignored a page_size that is
    # no whole number of 1 or more (the default page came back, as if none had been asked) and cut one over the
    # maximum down to it, while the schema documented any integer.
    r = world.client("staff").get(url, {"page_size": size})
    assert r.status_code == 400, (r.status_code, r.json())
    assert r.json()["code"] == "invalid" and "page_size" in r.json()["fields"], r.json()


def test_the_schema_documents_the_page_size_the_server_takes(world):
    import yaml

    spec = yaml.safe_load(world.client("staff").get("/api/schema/").content)
    params = {p["name"]: p for p in spec["paths"]["/api/v1/nodes/"]["get"]["parameters"]}
    assert params["page_size"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 500}
    assert params["page"]["schema"] == {"type": "integer", "minimum": 1}
    assert len(world.client("staff").get("/api/v1/nodes/", {"page_size": 500}).json()["results"]) == 4
