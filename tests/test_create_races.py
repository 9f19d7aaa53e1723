"""Two staff creates of the same name at once: one 201, the other the 400 envelope naming the field and
storing nothing; never the database's IntegrityError as a 500 (DESIGN §6: a 5xx on any input is a bug).

Deterministic: a second transaction inserts the same row and holds it uncommitted, so the API's own
"does it exist?" check sees nothing and its INSERT queues on the unique index; the holder then commits.
"""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from portal.core.models import AuditLog
from reservations.models import Node, Pool
from tenants.models import Membership, Quota, Tenant

from .conftest import make_world, wait_for_lock_waiter

pytestmark = pytest.mark.django_db(transaction=True)


def _pool_row(world):
    Pool.objects.create(name="b200", gpu_model="B200", gpus_per_node=8)


def _node_row(world):
    Node.objects.create(hostname="h100-new", pool=world.pool)


def _tenant_row(world):
    Tenant.objects.create(slug="gamma", name="Gamma")


def _user_row(world):
    get_user_model().objects.create_user(username="newbie")


def _membership_row(world):
    Membership.objects.create(tenant=world.tenants["alpha"], user=world.users["beta-lead"], role="member")


def _quota_row(world):
    Quota.objects.create(tenant=Tenant.objects.get(slug="gamma"), pool=world.pool, max_nodes=1)


CASES = [
    ("/api/v1/pools/", {"name": "b200", "gpu_model": "B200", "gpus_per_node": 8}, _pool_row, "reservations_pool",
     "name", Pool),
    ("/api/v1/nodes/", {"hostname": "h100-new", "pool": "h100"}, _node_row, "reservations_node", "hostname", Node),
    # The same host in DNS terms: hostnames are unique ignoring case, in the database (a unique index on
    # lower(hostname)), so a case-variant's INSERT queues behind the uncommitted one and loses, as a duplicate.
    ("/api/v1/nodes/", {"hostname": "H100-New", "pool": "h100"}, _node_row, "reservations_node", "hostname", Node),
    ("/api/v1/tenants/", {"slug": "gamma", "name": "Gamma"}, _tenant_row, "tenants_tenant", "slug", Tenant),
    ("/api/v1/users/", {"username": "newbie", "password": "A-long-enough-pw-7"}, _user_row, "auth_user",
     "username", get_user_model()),
    ("/api/v1/memberships/", {"tenant": "alpha", "user": "beta-lead", "role": "member"}, _membership_row,
     "tenants_membership", "user", Membership),
    ("/api/v1/quotas/", {"tenant": "gamma", "pool": "h100", "max_nodes": 1}, _quota_row, "tenants_quota", "pool",
     Quota),
]


@pytest.mark.parametrize("url,body,insert,table,field,model", CASES,
                         ids=[c[0].split("/")[3] + ("-case-variant" if c[1].get("hostname") == "H100-New" else "")
                              for c in CASES])
def test_a_create_racing_a_duplicate_is_a_400_not_a_500(url, body, insert, table, field, model):
    world = make_world()
    Tenant.objects.create(slug="gamma", name="Gamma") if url.endswith("/quotas/") else None
    before = model.objects.count()
    audits = AuditLog.objects.count()
    inserted, release = threading.Event(), threading.Event()
    failures: list = []

    def hold():
        try:
            with transaction.atomic():
                insert(world)
                inserted.set()
                release.wait(30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
            inserted.set()
        finally:
            connection.close()

    result: dict = {}

    def post():
        client = world.client("staff")
        client.raise_request_exception = False
        try:
            result["response"] = client.post(url, body, format="json")
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inserted.wait(10) and not failures, failures
    poster = threading.Thread(target=post)
    poster.start()
    wait_for_lock_waiter(table)  # the API's INSERT queues behind the uncommitted duplicate
    release.set()
    holder.join(30)
    poster.join(30)
    r = result["response"]
    assert r.status_code == 400, (r.status_code, r.content[:300])
    assert r.json()["code"] == "invalid" and field in r.json()["fields"], r.json()
    assert model.objects.count() == before + 1  # the holder's row only
    assert AuditLog.objects.count() == audits
