"""Django's user admin (superusers) goes through tenants.services: every account created, every
privilege (is_staff, is_superuser, is_active, groups, permissions) changed, every password set and
every account deleted there leaves an audit row naming who did it — as the API's user_create does."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.test import Client
from django.urls import reverse

from portal.core.models import AuditLog

pytestmark = pytest.mark.django_db

User = get_user_model()
PASSWORD = "pw-Long-enough-1"


@pytest.fixture
def superuser():
    return User.objects.create_superuser("root", "root@example.org", PASSWORD)


@pytest.fixture
def root(superuser) -> Client:
    client = Client()
    client.force_login(superuser)
    return client


def audit(action: str, user) -> list[AuditLog]:
    return list(AuditLog.objects.filter(action=action, object_type="auth.user", object_id=str(user.pk)))


def change_data(user, **overrides) -> dict:
    """The change form as the browser posts it, with overrides (True/False for check boxes)."""
    data = {
        "username": user.username, "first_name": user.first_name, "last_name": user.last_name,
        "email": user.email, "is_active": user.is_active, "is_staff": user.is_staff,
        "is_superuser": user.is_superuser, "groups": [str(g.pk) for g in user.groups.all()],
        "user_permissions": [str(p.pk) for p in user.user_permissions.all()],
        "date_joined_0": user.date_joined.strftime("%Y-%m-%d"), "date_joined_1": user.date_joined.strftime("%H:%M:%S"),
        "initial-date_joined_0": user.date_joined.strftime("%Y-%m-%d"),
        "initial-date_joined_1": user.date_joined.strftime("%H:%M:%S"),
        "last_login_0": "", "last_login_1": "", "_save": "Save",
    }
    data.update(overrides)
    for key in ("is_active", "is_staff", "is_superuser"):
        if data[key] is True:
            data[key] = "on"
        elif data[key] is False:
            del data[key]
    return data


def test_adding_a_user_in_the_admin_goes_through_user_create_and_is_audited(world, root, superuser):
    response = root.post(reverse("admin:auth_user_add"), {
        "username": "newbie", "usable_password": "true", "password1": "A-long-enough-pw-7",
        "password2": "A-long-enough-pw-7", "_save": "Save"})
    assert response.status_code == 302, response.content[:2000]
    user = User.objects.get(username="newbie")
    assert response["Location"] == reverse("admin:auth_user_change", args=[user.pk])  # as Django's own admin does
    assert user.check_password("A-long-enough-pw-7") and not user.is_staff
    rows = audit("user.create", user)
    assert len(rows) == 1 and rows[0].actor_id == superuser.pk and rows[0].after["username"] == "newbie"
    assert "A-long-enough-pw-7" not in str(rows[0].after) and user.password not in str(rows[0].after)

    # Password-based sign-in disabled (e.g. an SSO-only account): still created, still audited.
    response = root.post(reverse("admin:auth_user_add"), {"username": "sso-only", "usable_password": "false",
                                                           "_save": "Save"})
    assert response.status_code == 302, response.content[:2000]
    sso = User.objects.get(username="sso-only")
    assert not sso.has_usable_password()
    assert len(audit("user.create", sso)) == 1


def test_the_add_form_still_refuses_what_django_refuses(world, root):
    response = root.post(reverse("admin:auth_user_add"), {
        "username": "STAFF", "usable_password": "true", "password1": "short", "password2": "short"})
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "username" in errors and "password2" in errors
    assert not User.objects.filter(username="STAFF").exists()
    assert not AuditLog.objects.filter(action="user.create").exists()


def test_granting_and_revoking_privileges_in_the_admin_is_audited(world, root, superuser):
    target = world.users["alpha-member"]
    ops = Group.objects.create(name="ops")
    perm = Permission.objects.get(codename="change_user", content_type__app_label="auth")
    url = reverse("admin:auth_user_change", args=[target.pk])
    response = root.post(url, change_data(target, is_staff=True, is_superuser=True, email="m@example.org",
                                          groups=[str(ops.pk)], user_permissions=[str(perm.pk)]))
    assert response.status_code == 302, response.content[:3000]
    target.refresh_from_db()
    assert target.is_staff and target.is_superuser and target.email == "m@example.org"
    assert list(target.groups.all()) == [ops] and list(target.user_permissions.all()) == [perm]
    (row,) = audit("user.update", target)
    assert row.actor_id == superuser.pk
    assert row.before == {"is_staff": False, "is_superuser": False, "email": "", "groups": [],
                          "user_permissions": []}
    assert row.after == {"is_staff": True, "is_superuser": True, "email": "m@example.org", "groups": ["ops"],
                         "user_permissions": ["auth.change_user"]}

    # Deactivating and taking the privileges back: one more row, old → new.
    response = root.post(url, change_data(target, is_active=False, is_staff=False, is_superuser=False, groups=[],
                                          user_permissions=[]))
    assert response.status_code == 302, response.content[:3000]
    target.refresh_from_db()
    assert not (target.is_active or target.is_staff or target.is_superuser)
    assert not target.groups.exists() and not target.user_permissions.exists()
    rows = audit("user.update", target)
    assert len(rows) == 2
    last = max(rows, key=lambda r: r.pk)
    assert last.before == {"is_active": True, "is_staff": True, "is_superuser": True, "groups": ["ops"],
                           "user_permissions": ["auth.change_user"]}
    assert last.after == {"is_active": False, "is_staff": False, "is_superuser": False, "groups": [],
                          "user_permissions": []}

    # Saving without a change writes nothing.
    target.refresh_from_db()
    assert root.post(url, change_data(target)).status_code == 302
    assert len(audit("user.update", target)) == 2


def test_setting_a_password_in_the_admin_is_audited_and_works(world, root, superuser):
    target = world.users["alpha-member"]
    url = reverse("admin:auth_user_password_change", args=[target.pk])
    response = root.post(url, {"usable_password": "true", "password1": "Another-long-pw-9",
                               "password2": "Another-long-pw-9", "set-password": "Change password"})
    assert response.status_code == 302, response.content[:2000]
    target.refresh_from_db()
    assert target.check_password("Another-long-pw-9")
    (row,) = audit("user.set_password", target)
    assert row.actor_id == superuser.pk and row.after == {"password": "set"}
    assert "Another-long-pw-9" not in str(row.before) + str(row.after)

    # Disabling password sign-in is audited too.
    response = root.post(url, {"usable_password": "false", "unset-password": "Disable password-based authentication"})
    assert response.status_code == 302, response.content[:2000]
    target.refresh_from_db()
    assert not target.has_usable_password()
    assert [r.after for r in sorted(audit("user.set_password", target), key=lambda r: r.pk)] == [
        {"password": "set"}, {"password": "disabled"}]

    # A weak password is refused by the form: nothing changes, nothing is audited.
    response = root.post(url, {"password1": "short", "password2": "short"})
    assert response.status_code == 200 and "password2" in response.context["form"].errors
    assert len(audit("user.set_password", target)) == 2


def test_a_superuser_changing_their_own_password_stays_signed_in(world, root, superuser):
    url = reverse("admin:auth_user_password_change", args=[superuser.pk])
    response = root.post(url, {"usable_password": "true", "password1": "Another-long-pw-9",
                               "password2": "Another-long-pw-9", "set-password": "Change password"})
    assert response.status_code == 302
    assert root.get(reverse("admin:index")).status_code == 200
    assert len(audit("user.set_password", superuser)) == 1


def test_deleting_users_in_the_admin_is_audited(world, root, superuser):
    one, two, three = (User.objects.create_user(n, password=PASSWORD) for n in ("leaver-1", "leaver-2", "leaver-3"))
    response = root.post(reverse("admin:auth_user_delete", args=[one.pk]), {"post": "yes"})
    assert response.status_code == 302
    response = root.post(reverse("admin:auth_user_changelist"),
                         {"action": "delete_selected", "_selected_action": [two.pk, three.pk], "post": "yes"})
    assert response.status_code == 302
    assert not User.objects.filter(pk__in=[one.pk, two.pk, three.pk]).exists()
    for user in (one, two, three):
        (row,) = audit("user.delete", user)
        assert row.actor_id == superuser.pk and row.before["username"] == user.username


def test_plain_staff_still_cannot_manage_users(world):
    client = Client()
    client.force_login(world.users["staff"])  # is_staff without the auth permissions
    assert client.get(reverse("admin:auth_user_changelist")).status_code == 403
    target = world.users["alpha-member"]
    assert client.post(reverse("admin:auth_user_change", args=[target.pk]),
                       change_data(target, is_superuser=True)).status_code == 403
    assert client.post(reverse("admin:auth_user_password_change", args=[target.pk]),
                       {"password1": "Another-long-pw-9", "password2": "Another-long-pw-9"}).status_code == 403
    target.refresh_from_db()
    assert not target.is_superuser and not AuditLog.objects.filter(object_type="auth.user").exists()


def test_a_privilege_change_and_its_audit_row_land_together_or_not_at_all(world, root, monkeypatch):
    from tenants import services

    def broken_audit(**kwargs):
        raise RuntimeError("audit log unavailable")

    monkeypatch.setattr(services, "audit_record", broken_audit)
    target = world.users["alpha-member"]
    with pytest.raises(RuntimeError, match="audit log unavailable"):
        root.post(reverse("admin:auth_user_change", args=[target.pk]),
                  change_data(target, is_superuser=True, is_staff=True))
    target.refresh_from_db()
    assert not target.is_superuser and not target.is_staff
    with pytest.raises(RuntimeError, match="audit log unavailable"):
        root.post(reverse("admin:auth_user_add"), {"username": "ghost", "usable_password": "false", "_save": "Save"})
    assert not User.objects.filter(username="ghost").exists()


def test_a_user_holding_api_tokens_and_memberships_can_be_deleted_and_each_removal_is_audited(world, root):
    """The token admin offers no delete, so Django refused the whole account's deletion (403)."""
    from tenants.models import ApiToken, Membership
    from tenants.services import token_issue

    member = world.users["alpha-member"]
    token_issue(user=member)
    tokens = ApiToken.objects.filter(user=member).count()
    response = root.post(reverse("admin:auth_user_delete", args=[member.pk]), {"post": "yes"})
    assert response.status_code == 302, response.status_code
    assert not User.objects.filter(pk=member.pk).exists()
    assert not ApiToken.objects.filter(user_id=member.pk).exists()
    assert not Membership.objects.filter(user_id=member.pk).exists()
    (row,) = audit("user.delete", member)
    assert row.before["api_tokens"] == tokens >= 1
    assert AuditLog.objects.filter(action="membership.delete", before__user="alpha-member").exists()


def test_a_tenants_last_lead_cannot_be_deleted_in_the_admin(world, root):
    """Deleting the account took its lead membership with it: the tenant was left with nobody to manage it."""
    from tenants.models import Membership

    lead = world.users["alpha-lead"]
    assert list(Membership.objects.filter(tenant=world.tenants["alpha"], role="lead").values_list(
        "user_id", flat=True)) == [lead.pk]
    page = root.post(reverse("admin:auth_user_delete", args=[lead.pk]), {"post": "yes"}, follow=True)
    assert "last lead" in page.content.decode()
    assert User.objects.filter(pk=lead.pk).exists() and not audit("user.delete", lead)
    root.post(reverse("admin:auth_user_changelist"),
              {"action": "delete_selected", "_selected_action": [lead.pk], "post": "yes"}, follow=True)
    assert User.objects.filter(pk=lead.pk).exists()
    assert Membership.objects.filter(user=lead, role="lead").exists()


def test_group_privileges_changed_in_the_admin_are_audited(world, root, superuser):
    """A group's permissions are privileges of every member: Django's own group admin saved them with no
    audit row (adding auth.change_user to a staff member's group let them manage accounts, unrecorded)."""
    change_user = Permission.objects.get(content_type__app_label="auth", codename="change_user")
    view_user = Permission.objects.get(content_type__app_label="auth", codename="view_user")
    response = root.post(reverse("admin:auth_group_add"), {"name": "ops", "permissions": [str(view_user.pk)],
                                                             "_save": "Save"})
    assert response.status_code == 302, response.content.decode()[:2000]
    group = Group.objects.get(name="ops")
    world.users["staff"].groups.add(group)

    def rows(action):
        return list(AuditLog.objects.filter(action=action, object_type="auth.group", object_id=str(group.pk)))

    (created,) = rows("group.create")
    assert created.actor_id == superuser.pk
    assert created.after == {"name": "ops", "permissions": ["auth.view_user"]}

    response = root.post(reverse("admin:auth_group_change", args=[group.pk]),
                         {"name": "ops", "permissions": [str(view_user.pk), str(change_user.pk)], "_save": "Save"})
    assert response.status_code == 302
    assert set(group.permissions.values_list("codename", flat=True)) == {"view_user", "change_user"}
    (updated,) = rows("group.update")
    assert updated.actor_id == superuser.pk
    assert updated.before == {"permissions": ["auth.view_user"]}
    assert updated.after == {"permissions": ["auth.change_user", "auth.view_user"]}

    response = root.post(reverse("admin:auth_group_changelist"),
                         {"action": "delete_selected", "_selected_action": [group.pk], "post": "yes"})
    assert response.status_code == 302
    assert not Group.objects.filter(pk=group.pk).exists()
    (deleted,) = rows("group.delete")
    assert deleted.actor_id == superuser.pk
    assert deleted.before == {"name": "ops", "permissions": ["auth.change_user", "auth.view_user"],
                              "members": ["staff"]}


def test_deleting_several_users_reports_only_those_deleted(world, root):
    """With a tenant's last lead among the selection, the page said "Successfully deleted 2 users"."""
    lead = world.users["alpha-lead"]
    leaver = User.objects.create_user("leaver", password=PASSWORD)
    page = root.post(reverse("admin:auth_user_changelist"),
                     {"action": "delete_selected", "_selected_action": [lead.pk, leaver.pk], "post": "yes"},
                     follow=True)
    shown = [str(m) for m in page.context["messages"]]
    assert any("last lead" in m for m in shown)
    assert "Successfully deleted 1 user." in shown, shown
    assert User.objects.filter(pk=lead.pk).exists() and not User.objects.filter(pk=leaver.pk).exists()


def shown_on_page(user) -> dict:
    """The hidden values a user's change page posts with the form: what it showed (Django's
    show_hidden_initial on the account's fields)."""
    return {"initial-username": user.username, "initial-first_name": user.first_name,
            "initial-last_name": user.last_name, "initial-email": user.email,
            "initial-is_active": str(user.is_active), "initial-is_staff": str(user.is_staff),
            "initial-is_superuser": str(user.is_superuser),
            "initial-groups": [str(g.pk) for g in user.groups.all()],
            "initial-user_permissions": [str(p.pk) for p in user.user_permissions.all()]}


def test_a_stale_user_page_does_not_re_enable_an_account_disabled_since(world, root, superuser):
    """Admin A disables an account; admin B, on the account's page opened before, only fixes its email: that
    save posted "active" as the page had shown it and re-enabled the account. Now what B left alone is not
    written, and a field B changed that A also changed is refused."""
    target = world.users["alpha-member"]
    url = reverse("admin:auth_user_change", args=[target.pk])
    page = root.get(url)
    assert 'name="initial-is_active"' in page.content.decode()  # the page posts what it showed
    as_shown = User.objects.get(pk=target.pk)
    other = Client()
    other.force_login(User.objects.create_superuser("root2", "root2@example.org", PASSWORD))

    disabled = root.post(url, {**change_data(as_shown, is_active=False, first_name="Ann"),
                               **shown_on_page(as_shown)})
    assert disabled.status_code == 302, disabled.content.decode()[:3000]
    assert User.objects.get(pk=target.pk).is_active is False

    fixed = other.post(url, {**change_data(as_shown, email="member@alpha.example"), **shown_on_page(as_shown)})
    assert fixed.status_code == 302, fixed.content.decode()[:3000]
    now = User.objects.get(pk=target.pk)
    assert (now.email, now.is_active, now.first_name) == ("member@alpha.example", False, "Ann")

    clash = other.post(url, {**change_data(as_shown, first_name="Bea"), **shown_on_page(as_shown)})
    assert clash.status_code == 200 and "changed since you opened" in clash.content.decode()
    assert User.objects.get(pk=target.pk).first_name == "Ann"
