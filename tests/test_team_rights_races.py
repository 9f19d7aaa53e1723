"""Races in the tenants app, found in a review: rights decided before a lock (a lead demoted or removed while the
request ran still acted), rows re-read under a lock after a concurrent delete (500s), tokens and accounts changing
under a request. Real threads on the real database (tests/racing.py)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client

from tenants.choices import Role
from tenants.models import Membership

from .conftest import make_world
from .racing import behind_a_lock, demoting

pytestmark = pytest.mark.django_db(transaction=True)


def _delete(model, pk: int):
    """Another transaction deleting the row (what the delete services lock and do), not yet committed."""
    def hold() -> None:
        model.objects.select_for_update().get(pk=pk).delete()
    return hold


def _delete_user(pk: int):
    """An account's deletion in flight (its memberships and tokens cascade)."""
    from django.contrib.auth import get_user_model

    return _delete(get_user_model(), pk)


def _lead_with_a_second_lead(world):
    """alpha's lead, and the member made a lead too (so the tenant keeps one whatever happens to the first)."""
    tenant = world.tenants["alpha"]
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)
    return Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])


def _browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_adding_a_member_by_api_is_refused(change):
    world = make_world()
    lead = _lead_with_a_second_lead(world)
    client = world.client("alpha-lead")
    response = behind_a_lock(demoting(lead.pk, change), lambda: client.post(
        "/api/v1/memberships/", {"tenant": "alpha", "user": "beta-lead", "role": "lead"}, format="json"),
        waits_on="tenants_membership")
    assert response.status_code == 403, response.json()
    assert response.json()["code"] == "permission_denied"
    assert not Membership.objects.filter(tenant=world.tenants["alpha"], user=world.users["beta-lead"]).exists()


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_rotating_the_feed_is_refused(change):
    world = make_world()
    tenant = world.tenants["alpha"]
    tenant.ical_token = "alpha-feed-secret-0123456789"
    tenant.save(update_fields=["ical_token"])
    lead = _lead_with_a_second_lead(world)
    client = _browser(world.users["alpha-lead"])
    response = behind_a_lock(demoting(lead.pk, change), lambda: client.post("/tenant/calendar-feed/rotate/"),
                             waits_on="tenants_membership")
    assert response.status_code == 403
    tenant.refresh_from_db()
    assert tenant.ical_token == "alpha-feed-secret-0123456789"  # every member's address still works


def _create_user(staff, name: str, barrier: threading.Barrier, results: list) -> None:
    from portal.core.exceptions import InvalidInput
    from tenants.services import user_create

    try:
        barrier.wait(30)
        results.append(user_create(actor=staff, username=name, password="Another-long-pw-9"))
    except InvalidInput as exc:
        results.append(exc)
    finally:
        connection.close()


def test_two_accounts_differing_only_in_case_cannot_be_created_at_once():
    """user_create refuses a name that differs from one in use only in case; two such creates racing must not
    both pass that check (found in a review: each checked before the other had committed, and the database's
    unique index on username is case-sensitive, so 'Racer' and 'racer' both came to exist)."""
    from django.contrib.auth import get_user_model

    from portal.core.exceptions import InvalidInput

    User = get_user_model()
    staff = User.objects.create_user(username="staff", password="pw-Long-enough-1", is_staff=True)
    for round_no in range(8):
        names = [f"Racer{round_no}", f"racer{round_no}"]
        barrier = threading.Barrier(len(names))
        results: list = []
        threads = [threading.Thread(target=_create_user, args=(staff, name, barrier, results)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(results) == 2
        assert User.objects.filter(username__iexact=names[0]).count() == 1, (round_no, results)
        refused = [r for r in results if isinstance(r, InvalidInput)]
        assert len(refused) == 1 and "username" in refused[0].fields


def test_a_quota_deleted_while_a_patch_waits_is_not_found():
    """PATCH /quotas/{id}/ found the row, then waited on the lock of a delete that committed: the service's .get()
    raised DoesNotExist, a 500. It is the 404 envelope now, and nothing comes back."""
    from tenants.models import Quota

    world = make_world()
    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    client = world.client("staff")
    client.raise_request_exception = False
    response = behind_a_lock(_delete(Quota, quota.pk), lambda: client.patch(
        f"/api/v1/quotas/{quota.pk}/", {"max_nodes": 5}, format="json"), waits_on="tenants_quota")
    assert response.status_code == 404, response.content
    assert response.json()["code"] == "not_found"
    assert not Quota.objects.filter(pk=quota.pk).exists()


def test_a_quota_deleted_twice_at_once_is_not_found_the_second_time():
    """Two admins deleting the same quota: the second delete waited on the first's lock, then .get() raised
    DoesNotExist (a 500 page). It is NotFound (404) now, and the one delete is audited once."""
    from portal.core.exceptions import NotFound
    from portal.core.models import AuditLog
    from tenants.models import Quota
    from tenants.services import quota_delete

    world = make_world()
    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    result = behind_a_lock(_delete(Quota, quota.pk), lambda: quota_delete(actor=world.users["staff"], quota=quota),
                           waits_on="tenants_quota")
    assert isinstance(result, NotFound), result
    assert not AuditLog.objects.filter(action="quota.delete").exists()


@pytest.mark.parametrize("service", ["membership_update", "membership_delete"])
def test_a_membership_deleted_while_a_change_waits_is_not_found(service):
    """The admin's membership change or removal that waited on a concurrent removal raised DoesNotExist (a 500
    page); it is NotFound now, and nothing is written or audited."""
    from portal.core.exceptions import NotFound
    from portal.core.models import AuditLog
    from tenants import services

    world = make_world()
    membership = Membership.objects.get(tenant=world.tenants["alpha"], user=world.users["alpha-member"])
    kwargs = {"role": Role.VIEWER} if service == "membership_update" else {}
    result = behind_a_lock(_delete(Membership, membership.pk), lambda: getattr(services, service)(
        actor=world.users["staff"], membership=membership, **kwargs), waits_on="tenants_membership")
    assert isinstance(result, NotFound), result
    assert not Membership.objects.filter(pk=membership.pk).exists()
    assert not AuditLog.objects.filter(action__startswith="membership.").exists()


@pytest.mark.parametrize("service", ["user_update", "user_set_password", "user_delete", "token_revoke"])
def test_an_account_deleted_while_a_change_waits_is_not_found(service):
    """The user admin's change, password, deletion or token revocation that waited on the account's deletion
    raised DoesNotExist (a 500 page); it is NotFound now, and nothing is audited."""
    from portal.core.exceptions import NotFound
    from portal.core.models import AuditLog
    from tenants import services
    from tenants.models import ApiToken

    world = make_world()
    user, staff = world.users["alpha-viewer"], world.users["staff"]
    token = ApiToken.objects.filter(user=user).first()
    call = {
        "user_update": lambda: services.user_update(actor=staff, user=user, email="x@example.com"),
        "user_set_password": lambda: services.user_set_password(actor=staff, user=user, password="Another-long-pw-9"),
        "user_delete": lambda: services.user_delete(actor=staff, user=user),
        "token_revoke": lambda: services.token_revoke(actor=staff, token=token),
    }[service]
    result = behind_a_lock(_delete_user(user.pk), call,
                           waits_on="tenants_apitoken" if service == "token_revoke" else "auth_user")
    assert isinstance(result, NotFound), result
    assert not AuditLog.objects.filter(action__in=["user.update", "user.set_password", "user.delete",
                                                   "token.revoke"]).exists()


def test_a_tokens_last_use_never_moves_back():
    """Authentication wrote its own clock reading unconditionally: a request that read the clock, then waited on
    the token's row while a later use was recorded, overwrote that with its earlier time."""
    from django.utils import timezone

    from tenants.models import ApiToken

    world = make_world()
    token = ApiToken.objects.get(user=world.users["alpha-viewer"])
    assert token.last_used_at is None
    wrote = {}

    def hold():
        """A request that read the clock later but writes first: it holds the row, then records its use."""
        locked = ApiToken.objects.select_for_update().get(pk=token.pk)

        def record() -> None:
            locked.last_used_at = wrote["at"] = timezone.now()
            locked.save(update_fields=["last_used_at"])
        return record

    client = world.client("alpha-viewer")
    response = behind_a_lock(hold, lambda: client.get("/api/v1/tenants/"), waits_on="tenants_apitoken")
    assert response.status_code == 200
    token.refresh_from_db()
    assert token.last_used_at == wrote["at"]


def test_a_request_that_waited_on_its_tokens_revocation_is_refused():
    """A request whose authentication queued on the token's row behind a revocation went on, once the revocation
    had committed, as the token's user: revoking promises that every request presenting it from now on is
    refused."""
    from tenants.models import ApiToken

    world = make_world()
    token = ApiToken.objects.get(user=world.users["alpha-viewer"])

    def revoke() -> None:  # token_revoke's transaction: lock, revoked = true
        locked = ApiToken.objects.select_for_update().get(pk=token.pk)
        locked.revoked = True
        locked.save(update_fields=["revoked"])

    client = world.client("alpha-viewer")
    response = behind_a_lock(revoke, lambda: client.get("/api/v1/tenants/"), waits_on="tenants_apitoken")
    assert response.status_code == 401, response.content
    assert response.json()["code"] == "not_authenticated"


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_setting_the_slack_url_is_refused(change):
    """The notification settings page checks the lead's role when the request starts, and tenant_slack_webhook_set
    checked nothing: a lead demoted or removed meanwhile still pointed the tenant's notifications at a URL of
    their choosing. The service now decides under the team lock."""
    from tenants.models import Tenant

    world = make_world()
    lead = _lead_with_a_second_lead(world)
    client = _browser(world.users["alpha-lead"])
    response = behind_a_lock(demoting(lead.pk, change), lambda: client.post(
        "/notifications/slack/url/", {"url": "https://hooks.slack.com/services/T1/B1/mine"}),
        waits_on="tenants_membership")
    assert response.status_code in (302, 403)
    assert Tenant.objects.get(pk=world.tenants["alpha"].pk).slack_webhook_url == ""


def test_an_account_deleted_while_a_lead_adds_it_is_refused():
    """team_member_add found the user, then its membership's (deferred) foreign key waited at commit on the
    account's deletion in flight, and the commit failed with an IntegrityError: a 500 page. The account's row
    is now locked before the insert, and an account gone (or disabled) meanwhile reads as no active user."""
    from portal.core.exceptions import InvalidInput
    from tenants.services import team_member_add

    world = make_world()
    tenant, gone = world.tenants["alpha"], world.users["beta-viewer"]
    result = behind_a_lock(_delete_user(gone.pk), lambda: team_member_add(
        actor=world.users["alpha-lead"], tenant=tenant, username=gone.username))
    assert isinstance(result, InvalidInput), result
    assert "username" in result.fields
    assert not Membership.objects.filter(user_id=gone.pk).exists()


def test_a_token_issued_while_its_account_is_deleted_is_refused():
    """token_issue_own locked the account's row but did not look at the answer: an account deleted while the
    request waited on that lock got a token inserted for it, and the commit failed on the foreign key (a 500)."""
    from portal.core.exceptions import DomainError
    from tenants.models import ApiToken
    from tenants.services import token_issue_own

    world = make_world()
    user = world.users["alpha-viewer"]
    result = behind_a_lock(_delete_user(user.pk), lambda: token_issue_own(user=user, name="late"),
                           waits_on="auth_user")
    assert isinstance(result, DomainError), result
    assert result.status in (403, 404)
    assert not ApiToken.objects.filter(user_id=user.pk).exists()


def test_a_bulk_quota_delete_that_meets_a_concurrent_delete_deletes_the_rest():
    """The quota admin's "Delete selected" called quota_delete row by row without run_service: a quota deleted
    by another admin meanwhile raised NotFound out of the action (a 500), and the quotas after it stayed."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    from tenants.models import Quota

    world = make_world()
    first = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    second = Quota.objects.get(tenant=world.tenants["beta"], pool=world.pool)
    admin_user = get_user_model().objects.create_user(username="root-admin", password="pw-Long-enough-1",
                                                       is_staff=True, is_superuser=True)
    client = _browser(admin_user)
    client.raise_request_exception = False
    response = behind_a_lock(_delete(Quota, first.pk), lambda: client.post(
        reverse("admin:tenants_quota_changelist"),
        {"action": "delete_selected", "_selected_action": [first.pk, second.pk], "post": "yes"}),
        waits_on="tenants_quota")
    assert response.status_code == 302, response.status_code
    assert not Quota.objects.filter(pk__in=[first.pk, second.pk]).exists()


def test_a_quota_saved_while_a_stale_admin_save_waits_is_not_overwritten():
    """The admin form's version is checked under the quota's row lock: a save that read the version, then
    waited on another admin's save in flight, is refused (InvalidState) once that commits, and the other's
    numbers stay. Checked before the lock, it would pass and write the numbers it saw over the newer ones."""
    from portal.core.exceptions import InvalidState
    from portal.core.models import AuditLog
    from tenants.models import Quota
    from tenants.selectors import quota_version
    from tenants.services import quota_update

    world = make_world()
    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    seen = quota_version(quota)

    def newer_edit() -> None:
        row = Quota.objects.select_for_update().get(pk=quota.pk)
        row.max_nodes = 7
        row.save()

    result = behind_a_lock(newer_edit, lambda: quota_update(actor=world.users["staff"], quota=quota,
                                                            expected_version=seen, max_nodes=2),
                           waits_on="tenants_quota")
    assert isinstance(result, InvalidState), result
    assert "changed since you opened" in result.detail
    assert Quota.objects.get(pk=quota.pk).max_nodes == 7
    assert not AuditLog.objects.filter(action="quota.update").exists()
    # With the version it has now, the same change goes through.
    fresh = Quota.objects.get(pk=quota.pk)
    quota_update(actor=world.users["staff"], quota=fresh, expected_version=quota_version(fresh), max_nodes=2)
    assert Quota.objects.get(pk=quota.pk).max_nodes == 2


def test_a_quota_saved_while_a_stale_list_edit_waits_is_not_overwritten():
    """The quota list's edits carry the numbers the page showed; quota_bulk_update compares them under the rows'
    locks, so a list save that waited on another admin's save in flight is refused once that commits, whole."""
    from portal.core.exceptions import InvalidState
    from portal.core.models import AuditLog
    from tenants.models import Quota
    from tenants.services import quota_bulk_update

    world = make_world()
    alpha = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    beta = Quota.objects.get(tenant=world.tenants["beta"], pool=world.pool)
    shown = {q.pk: {"max_nodes": q.max_nodes, "burst_nodes": q.burst_nodes, "max_duration_hours": None}
             for q in (alpha, beta)}

    def newer_edit() -> None:
        row = Quota.objects.select_for_update().get(pk=alpha.pk)
        row.max_nodes = 7
        row.save()

    result = behind_a_lock(newer_edit, lambda: quota_bulk_update(
        actor=world.users["staff"], changes=[(alpha.pk, {"burst_nodes": 2}), (beta.pk, {"burst_nodes": 2})],
        expected=shown), waits_on="tenants_quota")
    assert isinstance(result, InvalidState), result
    assert [(q.max_nodes, q.burst_nodes) for q in Quota.objects.filter(pk__in=[alpha.pk, beta.pk]).order_by("pk")] \
        == [(7, 1), (3, 1)]
    assert not AuditLog.objects.filter(action="quota.update").exists()


def test_a_tenant_renamed_while_a_stale_admin_rename_waits_is_not_renamed_back():
    """tenant_update's expected values (what the admin page showed) are compared under the tenant's row lock."""
    from portal.core.exceptions import InvalidState
    from tenants.models import Tenant
    from tenants.services import tenant_update

    world = make_world()
    tenant = world.tenants["alpha"]

    def newer_rename() -> None:
        Tenant.objects.select_for_update().filter(pk=tenant.pk).update(name="Alpha One")

    result = behind_a_lock(newer_rename, lambda: tenant_update(actor=world.users["staff"], tenant=tenant,
                                                               expected={"name": "Team Alpha"}, name="Alpha Two"),
                           waits_on="tenants_tenant")
    assert isinstance(result, InvalidState) and "name" in result.fields, result
    assert Tenant.objects.get(pk=tenant.pk).name == "Alpha One"


def test_a_role_changed_while_a_stale_admin_role_change_waits_is_not_changed_again():
    """membership_update's expected_role (what the admin page showed) is compared under the membership's lock."""
    from portal.core.exceptions import InvalidState
    from tenants.services import membership_update

    world = make_world()
    member = Membership.objects.get(tenant=world.tenants["alpha"], user=world.users["alpha-member"])

    def promoted() -> None:
        Membership.objects.select_for_update().filter(pk=member.pk).update(role=Role.LEAD)

    result = behind_a_lock(promoted, lambda: membership_update(actor=world.users["staff"], membership=member,
                                                               role=Role.VIEWER, expected_role=Role.MEMBER),
                           waits_on="tenants_membership")
    assert isinstance(result, InvalidState), result
    assert Membership.objects.get(pk=member.pk).role == Role.LEAD


def test_an_account_changed_while_a_stale_admin_change_waits_is_not_changed_back():
    """user_update's expected values (what the user admin page showed) are compared under the account's lock."""
    from django.contrib.auth import get_user_model

    from portal.core.exceptions import InvalidState
    from tenants.services import user_update

    world = make_world()
    target = world.users["alpha-member"]
    User = get_user_model()

    def disabled_and_readdressed() -> None:
        User.objects.select_for_update().filter(pk=target.pk).update(is_active=False, email="a@alpha.example")

    result = behind_a_lock(disabled_and_readdressed, lambda: user_update(
        actor=world.users["staff"], user=target, expected={"email": ""}, email="b@alpha.example"),
        waits_on="auth_user")
    assert isinstance(result, InvalidState) and "email" in result.fields, result
    assert User.objects.filter(pk=target.pk).values_list("is_active", "email").get() == (False, "a@alpha.example")


def test_a_pool_rate_changed_while_a_stale_admin_change_waits_is_not_changed_back():
    """pool_update's expected values (what the pool's admin page showed) are compared under the pool's lock."""
    from decimal import Decimal

    from portal.core.exceptions import InvalidState
    from reservations.models import Pool
    from reservations.services import pool_update

    world = make_world()
    pool = world.pool

    def repriced() -> None:
        Pool.objects.select_for_update().filter(pk=pool.pk).update(on_demand_rate=Decimal("3.75"))

    result = behind_a_lock(repriced, lambda: pool_update(actor=world.users["staff"], pool=pool,
                                                         expected={"on_demand_rate": Decimal("2.5")},
                                                         on_demand_rate=Decimal("1.00")),
                           waits_on="reservations_pool")
    assert isinstance(result, InvalidState) and "on_demand_rate" in result.fields, result
    assert Pool.objects.get(pk=pool.pk).on_demand_rate == Decimal("3.75")


def test_a_pool_capability_changed_while_a_stale_admin_change_waits_is_not_changed_back():
    """pool_capability_set's expected values (what the capability's admin page showed) are compared under the
    pool's lock, which the admin's save waits on while another writer holds it."""
    from portal.core.exceptions import InvalidState
    from provisioning.models import PoolCapability
    from provisioning.services import pool_capability_set
    from reservations.models import Pool

    world = make_world()
    pool = world.pool
    pool_capability_set(actor=world.users["staff"], pool=pool, max_memory_per_gpu_gib=80)

    def changed() -> None:
        Pool.objects.select_for_update(no_key=True).filter(pk=pool.pk).values_list("pk", flat=True).first()
        PoolCapability.objects.filter(pool_id=pool.pk).update(max_memory_per_gpu_gib=120)

    result = behind_a_lock(changed, lambda: pool_capability_set(actor=world.users["staff"], pool=pool,
                                                                expected={"max_memory_per_gpu_gib": 80},
                                                                max_memory_per_gpu_gib=40),
                           waits_on="reservations_pool")
    assert isinstance(result, InvalidState) and "max_memory_per_gpu_gib" in result.fields, result
    assert PoolCapability.objects.get(pool_id=pool.pk).max_memory_per_gpu_gib == 120


def test_a_webhook_changed_while_a_stale_admin_change_waits_is_not_changed_back():
    """webhook_update's expected values (what the channel's admin page showed) are compared under the channel's
    lock, which the admin's save waits on while a lead's change holds it."""
    from notifications.models import Channel
    from notifications.services import webhook_create, webhook_update
    from portal.core.exceptions import InvalidState

    world = make_world()
    channel, _ = webhook_create(actor=world.users["alpha-lead"], tenant=world.tenants["alpha"],
                                url="https://93.184.216.34/hook", name="ops", events=["reservation.changed"])

    def changed() -> None:
        Channel.objects.select_for_update().filter(pk=channel.pk).update(events=["quota.threshold"])

    result = behind_a_lock(changed, lambda: webhook_update(actor=world.users["staff"], channel=channel,
                                                           events=["reservation.cancelled"],
                                                           expected={"events": ["reservation.changed"]}),
                           waits_on="notifications_channel")
    assert isinstance(result, InvalidState) and "events" in result.fields, result
    assert Channel.objects.get(pk=channel.pk).events == ["quota.threshold"]
