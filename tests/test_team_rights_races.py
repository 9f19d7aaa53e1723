"""Races in the tenants app, found in a review: rights decided before a lock (a lead demoted or removed while the
request ran still acted), rows re-read under a lock after a concurrent delete (500s), tokens and accounts changing
under a request. Real threads on the real database."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from tenants.choices import Role
from tenants.models import Membership

from .conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)


def _demote_and_hold(membership_pk: int, role: str | None, locked: threading.Event, release: threading.Event):
    """Another transaction demoting (role) or removing (None) a lead, not yet committed: the lock the team
    services take (the tenant's lead rows, FOR UPDATE) is held until release."""
    try:
        with transaction.atomic():
            membership = Membership.objects.select_for_update().get(pk=membership_pk)
            list(Membership.objects.select_for_update().filter(tenant_id=membership.tenant_id, role=Role.LEAD))
            if role is None:
                membership.delete()
            else:
                membership.role = role
                membership.save(update_fields=["role"])
            locked.set()
            release.wait(30)
    finally:
        connection.close()


def _post_in_thread(client, result: dict, body: dict):
    try:
        result["response"] = client.post("/api/v1/memberships/", body, format="json")
    finally:
        connection.close()


def _waiting_on_a_lock(table: str = "tenants_membership") -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query ILIKE %s AND pid <> pg_backend_pid()", [f"%{table}%"])
        return bool(cur.fetchone()[0])


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_adding_a_member_by_api_is_refused(change):
    world = make_world()
    tenant = world.tenants["alpha"]
    lead = Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)  # stays a lead
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_demote_and_hold, args=(lead.pk, change, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    poster = threading.Thread(target=_post_in_thread, args=(world.client("alpha-lead"), result,
                                                              {"tenant": "alpha", "user": "beta-lead", "role": "lead"}))
    poster.start()
    # Either the request queues on the team lock (then the demotion commits first), or it ran past it.
    while poster.is_alive() and not _waiting_on_a_lock():
        poster.join(0.02)
    release.set()
    holder.join(30)
    poster.join(30)
    response = result["response"]
    assert response.status_code == 403, response.json()
    assert response.json()["code"] == "permission_denied"
    assert not Membership.objects.filter(tenant=tenant, user=world.users["beta-lead"]).exists()


def _rotate_in_thread(client, result: dict):
    try:
        result["response"] = client.post("/tenant/calendar-feed/rotate/")
    finally:
        connection.close()


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_rotating_the_feed_is_refused(change):
    from django.test import Client

    world = make_world()
    tenant = world.tenants["alpha"]
    tenant.ical_token = "alpha-feed-secret-0123456789"
    tenant.save(update_fields=["ical_token"])
    lead = Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)
    client = Client()
    client.force_login(world.users["alpha-lead"])
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_demote_and_hold, args=(lead.pk, change, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    rotator = threading.Thread(target=_rotate_in_thread, args=(client, result))
    rotator.start()
    while rotator.is_alive() and not _waiting_on_a_lock():
        rotator.join(0.02)
    release.set()
    holder.join(30)
    rotator.join(30)
    assert result["response"].status_code == 403
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


def _delete_quota_and_hold(quota_pk: int, locked: threading.Event, release: threading.Event):
    """Another transaction deleting the quota (quota_delete's lock and delete), not yet committed."""
    from tenants.models import Quota

    try:
        with transaction.atomic():
            Quota.objects.select_for_update().get(pk=quota_pk).delete()
            locked.set()
            release.wait(30)
    finally:
        connection.close()


def _patch_in_thread(client, url: str, body: dict, result: dict):
    try:
        result["response"] = client.patch(url, body, format="json")
    finally:
        connection.close()


def test_a_quota_deleted_while_a_patch_waits_is_not_found():
    """PATCH /quotas/{id}/ found the row, then waited on the lock of a delete that committed: the service's .get()
    raised DoesNotExist, a 500. It is the 404 envelope now, and nothing comes back."""
    from tenants.models import Quota

    world = make_world()
    quota = Quota.objects.get(tenant=world.tenants["alpha"], pool=world.pool)
    client = world.client("staff")
    client.raise_request_exception = False
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_delete_quota_and_hold, args=(quota.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    patcher = threading.Thread(target=_patch_in_thread,
                               args=(client, f"/api/v1/quotas/{quota.pk}/", {"max_nodes": 5}, result))
    patcher.start()
    while patcher.is_alive() and not _waiting_on_a_lock("tenants_quota"):
        patcher.join(0.02)
    release.set()
    holder.join(30)
    patcher.join(30)
    response = result["response"]
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
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_delete_quota_and_hold, args=(quota.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}

    def delete() -> None:
        try:
            quota_delete(actor=world.users["staff"], quota=quota)
            result["value"] = "deleted"
        except Exception as exc:  # noqa: BLE001
            result["value"] = exc
        finally:
            connection.close()

    deleter = threading.Thread(target=delete)
    deleter.start()
    while deleter.is_alive() and not _waiting_on_a_lock("tenants_quota"):
        deleter.join(0.02)
    release.set()
    holder.join(30)
    deleter.join(30)
    assert isinstance(result["value"], NotFound), result["value"]
    assert not AuditLog.objects.filter(action="quota.delete").exists()


def _delete_membership_and_hold(membership_pk: int, locked: threading.Event, release: threading.Event):
    try:
        with transaction.atomic():
            Membership.objects.select_for_update().get(pk=membership_pk).delete()
            locked.set()
            release.wait(30)
    finally:
        connection.close()


@pytest.mark.parametrize("service", ["membership_update", "membership_delete"])
def test_a_membership_deleted_while_a_change_waits_is_not_found(service):
    """The admin's membership change or removal that waited on a concurrent removal raised DoesNotExist (a 500
    page); it is NotFound now, and nothing is written or audited."""
    from portal.core.exceptions import NotFound
    from portal.core.models import AuditLog
    from tenants import services

    world = make_world()
    membership = Membership.objects.get(tenant=world.tenants["alpha"], user=world.users["alpha-member"])
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_delete_membership_and_hold, args=(membership.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    kwargs = {"role": Role.VIEWER} if service == "membership_update" else {}

    def change() -> None:
        try:
            result["value"] = getattr(services, service)(actor=world.users["staff"], membership=membership, **kwargs)
        except Exception as exc:  # noqa: BLE001
            result["value"] = exc
        finally:
            connection.close()

    changer = threading.Thread(target=change)
    changer.start()
    while changer.is_alive() and not _waiting_on_a_lock("tenants_membership"):
        changer.join(0.02)
    release.set()
    holder.join(30)
    changer.join(30)
    assert isinstance(result["value"], NotFound), result["value"]
    assert not Membership.objects.filter(pk=membership.pk).exists()
    assert not AuditLog.objects.filter(action__startswith="membership.").exists()


def _delete_user_and_hold(user_pk: int, locked: threading.Event, release: threading.Event):
    """Another transaction deleting the account (its memberships and tokens cascade), not yet committed."""
    from django.contrib.auth import get_user_model

    try:
        with transaction.atomic():
            get_user_model().objects.select_for_update().get(pk=user_pk).delete()
            locked.set()
            release.wait(30)
    finally:
        connection.close()


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
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_delete_user_and_hold, args=(user.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}

    def change() -> None:
        try:
            result["value"] = call()
        except Exception as exc:  # noqa: BLE001
            result["value"] = exc
        finally:
            connection.close()

    changer = threading.Thread(target=change)
    changer.start()
    table = "tenants_apitoken" if service == "token_revoke" else "auth_user"
    while changer.is_alive() and not _waiting_on_a_lock(table):
        changer.join(0.02)
    release.set()
    holder.join(30)
    changer.join(30)
    assert isinstance(result["value"], NotFound), result["value"]
    assert not AuditLog.objects.filter(action__in=["user.update", "user.set_password", "user.delete",
                                                   "token.revoke"]).exists()


def _hold_token_row(token_pk: int, locked: threading.Event, release: threading.Event, wrote: dict):
    """Another transaction on the token's row (a request that read the clock later but wrote first, or a revoke):
    it holds the row, and when released records a later use than the waiting request's."""
    from django.utils import timezone

    from tenants.models import ApiToken

    try:
        with transaction.atomic():
            token = ApiToken.objects.select_for_update().get(pk=token_pk)
            locked.set()
            release.wait(30)
            token.last_used_at = wrote["at"] = timezone.now()
            token.save(update_fields=["last_used_at"])
    finally:
        connection.close()


def _get_in_thread(client, url: str, result: dict):
    try:
        result["response"] = client.get(url)
    finally:
        connection.close()


def test_a_tokens_last_use_never_moves_back():
    """Authentication wrote its own clock reading unconditionally: a request that read the clock, then waited on
    the token's row while a later use was recorded, overwrote that with its earlier time."""
    from tenants.models import ApiToken

    world = make_world()
    token = ApiToken.objects.get(user=world.users["alpha-viewer"])
    assert token.last_used_at is None
    locked, release, wrote = threading.Event(), threading.Event(), {}
    holder = threading.Thread(target=_hold_token_row, args=(token.pk, locked, release, wrote))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    getter = threading.Thread(target=_get_in_thread, args=(world.client("alpha-viewer"), "/api/v1/tenants/", result))
    getter.start()
    while getter.is_alive() and not _waiting_on_a_lock("tenants_apitoken"):
        getter.join(0.02)
    release.set()
    holder.join(30)
    getter.join(30)
    assert result["response"].status_code == 200
    token.refresh_from_db()
    assert token.last_used_at == wrote["at"]


def _revoke_and_hold(token_pk: int, locked: threading.Event, release: threading.Event):
    """token_revoke's transaction (lock, revoked = true), committed on release."""
    from tenants.models import ApiToken

    try:
        with transaction.atomic():
            token = ApiToken.objects.select_for_update().get(pk=token_pk)
            token.revoked = True
            token.save(update_fields=["revoked"])
            locked.set()
            release.wait(30)
    finally:
        connection.close()


def test_a_request_that_waited_on_its_tokens_revocation_is_refused():
    """A request whose authentication queued on the token's row behind a revocation went on, once the revocation
    had committed, as the token's user: revoking promises that every request presenting it from now on is
    refused."""
    from tenants.models import ApiToken

    world = make_world()
    token = ApiToken.objects.get(user=world.users["alpha-viewer"])
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_revoke_and_hold, args=(token.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    getter = threading.Thread(target=_get_in_thread, args=(world.client("alpha-viewer"), "/api/v1/tenants/", result))
    getter.start()
    while getter.is_alive() and not _waiting_on_a_lock("tenants_apitoken"):
        getter.join(0.02)
    release.set()
    holder.join(30)
    getter.join(30)
    response = result["response"]
    assert response.status_code == 401, response.content
    assert response.json()["code"] == "not_authenticated"


def _post_form_in_thread(client, url: str, data: dict, result: dict):
    try:
        result["response"] = client.post(url, data)
    finally:
        connection.close()


@pytest.mark.parametrize("change", [Role.VIEWER, None], ids=["demoted", "removed"])
def test_a_lead_demoted_or_removed_while_setting_the_slack_url_is_refused(change):
    """The notification settings page checks the lead's role when the request starts, and tenant_slack_webhook_set
    checked nothing: a lead demoted or removed meanwhile still pointed the tenant's notifications at a URL of
    their choosing. The service now decides under the team lock."""
    from django.test import Client

    from tenants.models import Tenant

    world = make_world()
    tenant = world.tenants["alpha"]
    lead = Membership.objects.get(tenant=tenant, user=world.users["alpha-lead"])
    Membership.objects.filter(tenant=tenant, user=world.users["alpha-member"]).update(role=Role.LEAD)
    client = Client()
    client.force_login(world.users["alpha-lead"])
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_demote_and_hold, args=(lead.pk, change, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}
    poster = threading.Thread(target=_post_form_in_thread, args=(
        client, "/notifications/slack/url/", {"url": "https://hooks.slack.com/services/T1/B1/mine"}, result))
    poster.start()
    while poster.is_alive() and not _waiting_on_a_lock():
        poster.join(0.02)
    release.set()
    holder.join(30)
    poster.join(30)
    assert result["response"].status_code in (302, 403)
    assert Tenant.objects.get(pk=tenant.pk).slack_webhook_url == ""


def test_an_account_deleted_while_a_lead_adds_it_is_refused():
    """team_member_add found the user, then its membership's (deferred) foreign key waited at commit on the
    account's deletion in flight, and the commit failed with an IntegrityError: a 500 page. The account's row
    is now locked before the insert, and an account gone (or disabled) meanwhile reads as no active user."""
    from portal.core.exceptions import InvalidInput
    from tenants.services import team_member_add

    world = make_world()
    tenant, gone = world.tenants["alpha"], world.users["beta-viewer"]
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_delete_user_and_hold, args=(gone.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}

    def add() -> None:
        try:
            result["value"] = team_member_add(actor=world.users["alpha-lead"], tenant=tenant, username=gone.username)
        except Exception as exc:  # noqa: BLE001
            result["value"] = exc
        finally:
            connection.close()

    adder = threading.Thread(target=add)
    adder.start()
    while adder.is_alive() and not _any_lock_waiter():
        adder.join(0.02)
    release.set()
    holder.join(30)
    adder.join(30)
    assert isinstance(result["value"], InvalidInput), result["value"]
    assert "username" in result["value"].fields
    assert not Membership.objects.filter(user_id=gone.pk).exists()


def _any_lock_waiter() -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        return bool(cur.fetchone()[0])


def test_a_token_issued_while_its_account_is_deleted_is_refused():
    """token_issue_own locked the account's row but did not look at the answer: an account deleted while the
    request waited on that lock got a token inserted for it, and the commit failed on the foreign key (a 500)."""
    from portal.core.exceptions import DomainError
    from tenants.models import ApiToken
    from tenants.services import token_issue_own

    world = make_world()
    user = world.users["alpha-viewer"]
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_delete_user_and_hold, args=(user.pk, locked, release))
    holder.start()
    assert locked.wait(10)
    result: dict = {}

    def issue() -> None:
        try:
            result["value"] = token_issue_own(user=user, name="late")
        except Exception as exc:  # noqa: BLE001
            result["value"] = exc
        finally:
            connection.close()

    issuer = threading.Thread(target=issue)
    issuer.start()
    while issuer.is_alive() and not _waiting_on_a_lock("auth_user"):
        issuer.join(0.02)
    release.set()
    holder.join(30)
    issuer.join(30)
    assert isinstance(result["value"], DomainError), result["value"]
    assert result["value"].status in (403, 404)
    assert not ApiToken.objects.filter(user_id=user.pk).exists()
