"""Browser pages answering hostile or odd input: no 500s, no secrets left in caches."""

from __future__ import annotations

import pytest

from portal.core.models import AuditLog

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("value", ["²", "٣", "1" * 5000])
def test_audit_tenant_filter_that_is_no_tenant_id_is_ignored_not_a_500(world, web, value):
    """str.isdigit() is true for "²" (int() refuses it) and for 5000 digits (over Python's int() limit):
    the audit page answered 500 to ?tenant=² instead of ignoring a filter naming none of the lead's tenants."""
    AuditLog.objects.create(action="quota.update", object_type="tenants.quota", object_id="1",
                            tenant_id=world.tenants["alpha"].pk)
    response = web("alpha-lead", raise_request_exception=False).get("/audit/", {"tenant": value})
    assert response.status_code == 200
    assert 'data-action="quota.update"' in response.content.decode()
