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
