"""The team page: a tenant's leads (and staff) add members, change roles and remove members; others read."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client

from portal.core.exceptions import DomainError
from portal.core.models import AuditLog
from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import Membership
from tenants.selectors import ical_feed_tenant

from ..conftest import feed_path

pytestmark = pytest.mark.django_db


def _roles(world, slug="alpha") -> dict[str, str]:
    return dict(Membership.objects.filter(tenant=world.tenants[slug]).values_list("user__username", "role"))


def _membership(world, username, slug="alpha") -> Membership:
    return Membership.objects.get(tenant=world.tenants[slug], user__username=username)


def test_leads_manage_others_read(web, world):
    world.users["alpha-member"].email = "member@example.org"
    world.users["alpha-member"].save()
    lead_page = web("alpha-lead").get("/team/").content.decode()
    for name in ("alpha-lead", "alpha-member", "alpha-viewer"):
        assert f'data-member="{name}"' in lead_page
    assert "member@example.org" in lead_page and "Add a member" in lead_page and "/team/members/" in lead_page
    assert "beta-" not in lead_page  # another tenant's people never show
    for who in ("alpha-member", "alpha-viewer"):
        page = web(who).get("/team/").content.decode()
        assert 'data-member="alpha-lead"' in page
        assert "member@example.org" not in page and "Add a member" not in page and "/role/" not in page
    assert 'href="/team/"' in lead_page  # in the navigation


def test_a_lead_adds_an_existing_user(web, world):
    before = _roles(world)
    response = web("alpha-lead").post("/team/members/", {"username": "beta-member", "role": "viewer"})
    assert response.status_code == 302 and response["Location"] == "/team/"
    assert _roles(world) == {**before, "beta-member": "viewer"}
    audit = AuditLog.objects.get(action="membership.create", after__user="beta-member")
    assert audit.actor == world.users["alpha-lead"] and audit.tenant_id == world.tenants["alpha"].pk
    # beta-member now sees alpha among their tenants.
    assert "alpha" in web("beta-member").get("/account/").content.decode()


@pytest.mark.parametrize("data,field", [
    ({"username": "nobody-here", "role": "member"}, "username"),
    ({"username": "alpha-member", "role": "member"}, "username"),  # already a member
    ({"username": "", "role": "member"}, "username"),
    ({"username": "beta-member", "role": "owner"}, "role"),
    ({"username": "x" * 151, "role": "member"}, "username"),
])
def test_bad_additions_change_nothing(web, world, data, field):
    before = _roles(world)
    response = web("alpha-lead").post("/team/members/", data)
    assert response.status_code == 400
    assert field in response.context["add_form"].errors
    assert _roles(world) == before


def test_adding_someone_already_in_the_team_says_so_and_where_to_change_their_role(web, world):
    """It said only "Already in use." beside the username (the unique constraint's words)."""
    before = _roles(world)
    response = web("alpha-lead").post("/team/members/", {"username": "alpha-member", "role": "viewer"})
    assert response.status_code == 400
    (message,) = response.context["add_form"].errors["username"]
    assert "alpha-member is already a member of Team Alpha" in message and "role" in message
    assert "Already in use" not in response.content.decode()
    assert _roles(world) == before


def test_a_nul_in_the_username_is_refused_before_the_page(web, world):
    before = _roles(world)
    response = web("alpha-lead").post("/team/members/", {"username": "beta-member\x00", "role": "member"})
    assert response.status_code == 400
    assert _roles(world) == before


def test_a_disabled_account_cannot_be_added(web, world):
    user = get_user_model().objects.create_user(username="gone", password="x", is_active=False)
    response = web("alpha-lead").post("/team/members/", {"username": user.username, "role": "member"})
    assert response.status_code == 400
    assert not Membership.objects.filter(user=user).exists()


def test_roles_change_and_the_last_lead_stays(web, world):
    lead = web("alpha-lead")
    member = _membership(world, "alpha-member")
    assert lead.post(f"/team/members/{member.pk}/role/", {"role": "lead"}).status_code == 302
    assert _roles(world)["alpha-member"] == "lead"
    # With two leads, one may step down...
    me = _membership(world, "alpha-lead")
    assert lead.post(f"/team/members/{me.pk}/role/", {"role": "member"}).status_code == 302
    assert _roles(world)["alpha-lead"] == "member"
    # ... and now is no lead: the page is read only and changes are refused.
    viewer = _membership(world, "alpha-viewer")
    page = lead.post(f"/team/members/{viewer.pk}/remove/", follow=True).content.decode()
    assert "Only the tenant&#x27;s leads" in page
    assert "alpha-viewer" in _roles(world)
    # The one lead left can neither step down nor be removed.
    new_lead = web("alpha-member")
    member = _membership(world, "alpha-member")
    for url, data in ((f"/team/members/{member.pk}/role/", {"role": "viewer"}),
                      (f"/team/members/{member.pk}/remove/", {})):
        page = new_lead.post(url, data, follow=True).content.decode()
        assert "last lead" in page
    assert _roles(world)["alpha-member"] == "lead"


def test_removing_a_member_ends_their_access(web, world, t0):
    viewer = world.users["alpha-viewer"]
    tenant_services.tenant_rotate_ical_token(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"])
    world.tenants["alpha"].refresh_from_db()
    feed = feed_path(world.tenants["alpha"], viewer)
    assert Client().get(feed).status_code == 200
    response = web("alpha-lead").post(f"/team/members/{_membership(world, 'alpha-viewer').pk}/remove/")
    assert response.status_code == 302
    assert "alpha-viewer" not in _roles(world)
    assert Client().get(feed).status_code == 404  # their personal calendar feed stops
    assert ical_feed_tenant(slug="alpha", token=feed.rsplit("/", 1)[1].removesuffix(".ics")) is None
    assert world.client("alpha-viewer").get("/api/v1/reservations/").json()["count"] == 0
    assert AuditLog.objects.filter(action="membership.delete", before__user="alpha-viewer").count() == 1


def test_a_lead_may_leave_when_another_lead_remains(web, world):
    Membership.objects.filter(tenant=world.tenants["alpha"], user__username="alpha-member").update(role=Role.LEAD)
    response = web("alpha-lead").post(f"/team/members/{_membership(world, 'alpha-lead').pk}/remove/")
    assert response.status_code == 302 and response["Location"] == "/"
    assert "alpha-lead" not in _roles(world)


@pytest.mark.parametrize("who", ["alpha-member", "alpha-viewer"])
def test_members_and_viewers_cannot_change_the_team(web, world, who):
    before = _roles(world)
    client = web(who)
    assert client.post("/team/members/", {"username": "beta-member", "role": "lead"}).status_code == 403
    target = _membership(world, "alpha-lead")
    client.post(f"/team/members/{target.pk}/role/", {"role": "viewer"})
    client.post(f"/team/members/{target.pk}/remove/")
    assert _roles(world) == before
    assert not AuditLog.objects.filter(action__startswith="membership.").exists()


def test_another_tenants_members_are_unknown(web, world, multi_tenant_user):
    """alpha-lead is also a viewer of beta; on alpha's page, beta's membership ids are simply unknown."""
    before = _roles(world, "beta")
    client = web("alpha-lead")
    target = _membership(world, "beta-member", "beta")
    for url, data in ((f"/team/members/{target.pk}/role/", {"role": "viewer"}),
                      (f"/team/members/{target.pk}/remove/", {})):
        page = client.post(url, data, follow=True).content.decode()
        assert "No such member of this tenant." in page
    assert _roles(world, "beta") == before
    # Switched to beta, where they are a viewer: the page reads, changes are refused.
    client.post("/tenant/switch/", {"tenant": "beta"})
    assert "Add a member" not in client.get("/team/").content.decode()
    assert client.post("/team/members/", {"username": "alpha-member", "role": "member"}).status_code == 403
    assert _roles(world, "beta") == before


def test_staff_manage_any_tenant(web, world):
    staff = web("staff")
    staff.post("/tenant/switch/", {"tenant": "beta"})
    assert staff.post("/team/members/", {"username": "alpha-viewer", "role": "member"}).status_code == 302
    assert _roles(world, "beta")["alpha-viewer"] == "member"


def test_signed_out_is_sent_to_sign_in(world):
    for method, url in (("get", "/team/"), ("post", "/team/members/")):
        response = getattr(Client(), method)(url)
        assert response.status_code == 302 and "/accounts/login/" in response["Location"]


@pytest.mark.django_db(transaction=True)
def test_two_leads_demoting_each_other_at_once_leave_one_lead():
    """Each demotion alone is allowed; together they would leave none. One wins, one is refused; no deadlock."""
    from tests.conftest import make_world

    world = make_world()
    tenant = world.tenants["alpha"]
    Membership.objects.filter(tenant=tenant, user__username="alpha-member").update(role=Role.LEAD)
    a, b = world.users["alpha-lead"], world.users["alpha-member"]
    pairs = [(a, Membership.objects.get(tenant=tenant, user=b)), (b, Membership.objects.get(tenant=tenant, user=a))]
    barrier = threading.Barrier(2)
    results: list = []

    def demote(actor, membership) -> None:
        try:
            barrier.wait(30)
            results.append(tenant_services.team_member_set_role(actor=actor, tenant=tenant,
                                                                 membership_id=membership.pk, role=Role.MEMBER))
        except DomainError as exc:
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=demote, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2
    assert sum(isinstance(r, Membership) for r in results) == 1, results
    refused = next(r for r in results if isinstance(r, DomainError))
    assert refused.code == "permission_denied"  # the loser is no lead any more by the time it runs
    assert Membership.objects.filter(tenant=tenant, role=Role.LEAD).count() == 1
