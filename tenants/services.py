"""Writes for tenants, memberships, quotas and API tokens."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from portal.core import events
from portal.core.exceptions import InvalidInput, InvalidState, NotFound, PermissionDenied
from portal.core.services import audit_record, refuse_stale

from .choices import Role
from .models import ApiToken, Membership, Quota, Tenant
from .selectors import quota_version

__all__ = [
    "tenant_create",
    "tenant_update",
    "user_create",
    "user_update",
    "user_set_password",
    "user_delete",
    "group_save",
    "group_delete",
    "membership_create",
    "quota_create",
    "quota_update",
    "token_issue",
    "token_revoke",
    "tenant_rotate_ical_token",
    "tenant_lead_lock",
    "tenant_slack_webhook_clear_locked",
    "tenant_slack_webhook_set_locked",
]

# Announced when a tenant's Slack URL is set (created, changed or replaced; not when cleared): the
# notifications app makes the tenant's Slack channel and tells it what is already going on.
SLACK_WEBHOOK_SET = "tenant.slack_webhook_set"
TENANT_FIELDS = ("slug", "name", "burst_enabled", "storage_quota_tib", "vlan_id", "cidr")

# Higher apps name a tenant's things elsewhere after its slug (Slurm reservations and accounts,
# Kubernetes namespaces and taints); each registers here why the slug must not change now
# (a function of the tenant returning a reason, or None). tenant_update asks them all.
SlugGuard = Callable[[Tenant], "str | None"]
_slug_guards: list[SlugGuard] = []


def slug_guard_register(guard: SlugGuard) -> None:
    if guard not in _slug_guards:
        _slug_guards.append(guard)
QUOTA_FIELDS = ("max_nodes", "burst_nodes", "max_duration_hours")


def _snapshot(obj: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in fields}


def _validate_network(cidr: str | None) -> str:
    if not cidr:
        return ""
    try:
        network = ipaddress.ip_network(cidr, strict=True)
    except ValueError as exc:
        raise InvalidInput(f"cidr: {exc}", fields={"cidr": str(exc)})
    # Python takes an IPv6 scope (zone) id ("fe80::%eth0/64"); PostgreSQL's inet, which the disjointness
    # constraint casts the column to, does not, and a tenant's segment is no link-local interface anyway.
    if getattr(network.network_address, "scope_id", None):
        message = "a network with a zone id (%…) cannot be a tenant's segment."
        raise InvalidInput(f"cidr: {message}", fields={"cidr": message[0].upper() + message[1:]})
    return str(network)


def _save_checked(obj: Any, *, integrity_fields: dict[str, str]) -> None:
    """full_clean then save; turn a constraint hit from a concurrent write into an `invalid` error."""
    try:
        obj.full_clean(validate_constraints=False, validate_unique=False)
    except ValidationError as exc:
        raise InvalidInput(
            "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items()),
            fields={k: " ".join(v) for k, v in exc.message_dict.items()},
        )
    try:
        with transaction.atomic():
            obj.save()
    except IntegrityError as exc:
        text = str(exc)
        for needle, field in integrity_fields.items():
            if needle in text:
                raise InvalidInput(f"{field}: already in use.", fields={field: "Already in use."})
        raise


def tenant_create(*, actor, slug: str, name: str, burst_enabled: bool = False, **extra: Any) -> Tenant:
    # The Slack URL meets tenant_update's checks (before the transaction: they resolve the host name).
    if "slack_webhook_url" in extra:
        extra["slack_webhook_url"] = _clean_slack_url(extra["slack_webhook_url"])
    return _tenant_create(actor=actor, slug=slug, name=name, burst_enabled=burst_enabled, extra=extra)


@transaction.atomic(durable=True)
def _tenant_create(*, actor, slug: str, name: str, burst_enabled: bool, extra: dict[str, Any]) -> Tenant:
    from portal.core.crypto import mask

    tenant = Tenant(slug=slug, name=name, burst_enabled=burst_enabled, ical_token=secrets.token_urlsafe(24))
    for key in ("storage_quota_tib", "vlan_id", "slack_webhook_url"):
        if key in extra:
            setattr(tenant, key, extra[key])
    tenant.cidr = _validate_network(extra.get("cidr"))
    _save_checked(tenant, integrity_fields={"slug": "slug", "vlan": "vlan_id", "cidr": "cidr"})
    after = _snapshot(tenant, TENANT_FIELDS)
    if tenant.slack_webhook_url:
        after["slack_webhook_url"] = mask(tenant.slack_webhook_url, keep=6)
    audit_record(actor=actor, action="tenant.create", obj=tenant, tenant_id=tenant.pk, after=after)
    if tenant.slack_webhook_url:
        events.emit(SLACK_WEBHOOK_SET, tenant_id=tenant.pk)
    return tenant


def tenant_update(*, actor, tenant: Tenant, expected: dict[str, Any] | None = None, **changes: Any) -> Tenant:
    """Change the tenant's fields. expected ({field: value}, what an edit page showed for the fields it changes):
    refused (InvalidState) if any of them is no longer so, checked under the tenant's row lock."""
    # The Slack URL is checked as tenant_slack_webhook_set checks it (before the transaction: it resolves
    # the host name) and audited masked, as there.
    if "slack_webhook_url" in changes:
        changes["slack_webhook_url"] = _clean_slack_url(changes["slack_webhook_url"])
    return _tenant_update(actor=actor, tenant=tenant, changes=changes, expected=expected or {})


@transaction.atomic(durable=True)
def _tenant_update(*, actor, tenant: Tenant, changes: dict[str, Any], expected: dict[str, Any]) -> Tenant:
    from portal.core.crypto import mask

    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    refuse_stale(key for key, value in expected.items() if key in TENANT_FIELDS and getattr(tenant, key) != value)
    before = _snapshot(tenant, TENANT_FIELDS)
    if "slack_webhook_url" in changes:
        before["slack_webhook_url"] = mask(tenant.slack_webhook_url, keep=6)
    if "slug" in changes and changes["slug"] != tenant.slug:
        for guard in _slug_guards:
            reason = guard(tenant)
            if reason:
                raise InvalidState(f"slug: {reason}; it can no longer change (rename the tenant's name instead).")
    for key, value in changes.items():
        if key == "cidr":
            value = _validate_network(value)
        if key in TENANT_FIELDS or key == "slack_webhook_url":
            setattr(tenant, key, value)
    after = _snapshot(tenant, TENANT_FIELDS)
    if after == before and not changes.get("slack_webhook_url"):
        return tenant  # nothing changed (a Slack URL given again is still set and announced): no save, no audit
    _save_checked(tenant, integrity_fields={"slug": "slug", "vlan": "vlan_id", "cidr": "cidr"})
    if "slack_webhook_url" in changes:
        after["slack_webhook_url"] = mask(tenant.slack_webhook_url, keep=6)
    audit_record(actor=actor, action="tenant.update", obj=tenant, tenant_id=tenant.pk, before=before, after=after)
    if changes.get("slack_webhook_url"):
        events.emit(SLACK_WEBHOOK_SET, tenant_id=tenant.pk)
    return tenant


def _locked_user(User: Any, pk: Any) -> Any:
    """The account's row, locked; NotFound when it is gone (deleted by a change this one waited for)."""
    locked = User._default_manager.select_for_update().filter(pk=pk).first()
    if locked is None:
        raise NotFound("No such account (it has just been deleted).")
    return locked


def _username_taken(User: Any, username: str, *, exclude_pk: Any = None) -> bool:
    # Django's own user-creation form (the admin's) refuses a name that differs from one in use only
    # in case: "Alice" and "alice" would be two accounts a lead could not tell apart when adding members.
    # The unique index on username is case-sensitive, so the check holds only under a lock on the name
    # as iexact compares it, to the end of the transaction: two creates of "Alice" and "alice" queue,
    # and the second sees the first's row.
    from django.db import connection

    from portal.core.locks import LOCK_USERNAME

    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(upper(%s)))",
                    [LOCK_USERNAME, User.normalize_username(username)])
    taken = User._default_manager.filter(**{f"{User.USERNAME_FIELD}__iexact": User.normalize_username(username)})
    return taken.exclude(pk=exclude_pk).exists() if exclude_pk is not None else taken.exists()


def _set_password(user: Any, password: str | None) -> None:
    """Validate and set a password; None disables password sign-in (the admin's "Disabled")."""
    if password is None:
        user.set_unusable_password()
        return
    try:
        validate_password(password, user)
    except ValidationError as exc:
        raise InvalidInput("password: " + " ".join(exc.messages), fields={"password": " ".join(exc.messages)})
    user.set_password(password)


@transaction.atomic(durable=True)
def user_create(*, actor, username: str, email: str = "", password: str | None) -> Any:
    """Create an account (the API's POST /users/ and Django's user admin); password None: no password sign-in."""
    User = get_user_model()
    user = User(username=username, email=email)
    if _username_taken(User, username):
        raise InvalidInput("username: already in use.", fields={"username": "Already in use."})
    _set_password(user, password)
    _save_checked(user, integrity_fields={"username": "username"})
    after = {"username": username, "email": email}
    if password is None:
        after["password"] = "disabled"
    audit_record(actor=actor, action="user.create", obj=user, after=after)
    return user


# What Django's user admin edits on an account; groups and user_permissions are privileges too (the
# admin's own permissions), audited by name.
USER_FIELDS = ("username", "first_name", "last_name", "email", "is_active", "is_staff", "is_superuser",
               "last_login", "date_joined")
USER_M2M = ("groups", "user_permissions")


def _user_m2m(user: Any, name: str) -> list[str]:
    if name == "groups":
        return sorted(user.groups.values_list("name", flat=True))
    return sorted(f"{app}.{codename}" for app, codename in
                  user.user_permissions.values_list("content_type__app_label", "codename"))


def _audit_value(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


@transaction.atomic(durable=True)
def user_update(*, actor, user: Any, expected: dict[str, Any] | None = None, **changes: Any) -> Any:
    """Change an account's fields and privileges (Django's user admin); one audit row, old → new.

    changes: any of USER_FIELDS, and groups / user_permissions (the complete new sets). Passwords
    are set by user_set_password only. expected ({field: value}, what an edit page showed for the fields it
    changes): refused (InvalidState) if any is no longer so, checked under the account's row lock.
    """
    User = get_user_model()
    unknown = set(changes) - set(USER_FIELDS) - set(USER_M2M)
    if unknown:
        raise InvalidInput(f"{', '.join(sorted(unknown))}: cannot be changed here.")
    locked = _locked_user(User, user.pk)
    stale = []
    for field, shown in (expected or {}).items():
        if field in USER_M2M:
            now = set(getattr(locked, field).values_list("pk", flat=True))
            if now != {getattr(item, "pk", item) for item in shown}:
                stale.append(field)
        elif field in USER_FIELDS and getattr(locked, field) != shown:
            stale.append(field)
    refuse_stale(stale, by="another admin")
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    for field in USER_FIELDS:
        if field in changes and changes[field] != getattr(locked, field):
            before[field], after[field] = _audit_value(getattr(locked, field)), _audit_value(changes[field])
            setattr(locked, field, changes[field])
    if "username" in after and _username_taken(User, after["username"], exclude_pk=locked.pk):
        raise InvalidInput("username: already in use.", fields={"username": "Already in use."})
    if before:
        _save_checked(locked, integrity_fields={"username": "username"})
    for name in USER_M2M:
        if name not in changes:
            continue
        old = _user_m2m(locked, name)
        getattr(locked, name).set(changes[name])
        new = _user_m2m(locked, name)
        if new != old:
            before[name], after[name] = old, new
    if before or after:
        audit_record(actor=actor, action="user.update", obj=locked, before=before, after=after)
    for field in USER_FIELDS:
        setattr(user, field, getattr(locked, field))
    return user


@transaction.atomic(durable=True)
def user_set_password(*, actor, user: Any, password: str | None) -> Any:
    """Set an account's password (None: disable password sign-in), audited without the password."""
    User = get_user_model()
    locked = _locked_user(User, user.pk)
    _set_password(locked, password)
    locked.save(update_fields=["password"])
    audit_record(actor=actor, action="user.set_password", obj=locked,
                 after={"password": "disabled" if password is None else "set"})
    user.password = locked.password
    return user


@transaction.atomic(durable=True)
def user_delete(*, actor, user: Any) -> None:
    """Delete an account (and what cascades with it: its memberships, its API tokens); the audit rows keep who it
    was. Refused while it is a tenant's last lead, as removing that membership is (make another member lead)."""
    User = get_user_model()
    locked = _locked_user(User, user.pk)
    for membership in Membership.objects.select_for_update(of=("self",)).select_related("user").filter(
            user=locked).order_by("tenant_id"):
        _remove_member(actor=actor, membership=membership)
    before = {f: _audit_value(getattr(locked, f)) for f in ("username", "email", "is_staff", "is_superuser")}
    before["api_tokens"] = locked.api_tokens.count()
    audit_record(actor=actor, action="user.delete", obj=locked, before=before)
    locked.delete()


# Groups: their permissions are privileges of every member, audited by name like a user's own.


def _group_permissions(group: Any) -> list[str]:
    return sorted(f"{app}.{codename}" for app, codename in
                  group.permissions.values_list("content_type__app_label", "codename"))


@transaction.atomic(durable=True)
def group_save(*, actor, group: Any, name: str, permissions: list[Any]) -> Any:
    """Create (group unsaved) or change a group's name and permissions (Django's group admin); one audit row."""
    from django.contrib.auth.models import Group

    if Group.objects.filter(name=name).exclude(pk=group.pk).exists():
        raise InvalidInput("name: a group with that name exists.", fields={"name": "Already in use."})
    if group.pk is None:
        group.name = name
        _save_checked(group, integrity_fields={"name": "name"})
        group.permissions.set(permissions)
        audit_record(actor=actor, action="group.create", obj=group,
                     after={"name": name, "permissions": _group_permissions(group)})
        return group
    locked = Group.objects.select_for_update().filter(pk=group.pk).first()
    if locked is None:
        raise NotFound("No such group (it has just been deleted).")
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    if locked.name != name:
        before["name"], after["name"] = locked.name, name
        locked.name = name
        _save_checked(locked, integrity_fields={"name": "name"})
    old = _group_permissions(locked)
    locked.permissions.set(permissions)
    new = _group_permissions(locked)
    if new != old:
        before["permissions"], after["permissions"] = old, new
    if before or after:
        audit_record(actor=actor, action="group.update", obj=locked, before=before, after=after)
    group.name = locked.name
    return group


@transaction.atomic(durable=True)
def group_delete(*, actor, group: Any) -> None:
    """Delete a group (its members lose its permissions); the audit row keeps its permissions and members."""
    from django.contrib.auth.models import Group

    locked = Group.objects.select_for_update().filter(pk=group.pk).first()
    if locked is None:
        return
    members = sorted(locked.user_set.values_list("username", flat=True))
    audit_record(actor=actor, action="group.delete", obj=locked,
                 before={"name": locked.name, "permissions": _group_permissions(locked), "members": members})
    locked.delete()


@transaction.atomic(durable=True)
def membership_create(*, actor, tenant: Tenant, user: Any, role: str = Role.MEMBER) -> Membership:
    """Add user to the tenant (the API's POST /memberships/ and the admin): staff, or one of the tenant's leads,
    decided under the team lock, so a lead demoted or removed while this runs adds no one. Only an active account,
    as on the team page: a disabled one made the tenant's other lead would leave it with no lead able to act."""
    current = _lock_account(pk=user.pk)
    _lock_team(actor=actor, tenant_id=tenant.pk)
    _check_role(role)
    if current is None:
        raise InvalidInput("user: no active user by that name.",
                           fields={"user": "No active user by that name; platform staff create accounts."})
    return _add_member(actor=actor, tenant=tenant, user=current, role=role, field="user")


def _lock_account(**lookup: Any) -> Any:
    """The active account matching lookup, its row locked FOR NO KEY UPDATE (its deletion, or a change, in
    flight is waited for and seen), or None. Taken before the team lock: user_delete locks the account, then
    its memberships and the lead rows of its tenants, in that order too."""
    return get_user_model()._default_manager.select_for_update(no_key=True).filter(is_active=True, **lookup).first()


def _add_member(*, actor, tenant: Tenant, user: Any, role: str, field: str) -> Membership:
    """Insert the membership (a duplicate, even a concurrent one, is `invalid` naming field); audited."""
    membership = Membership(tenant=tenant, user=user, role=role)
    _save_checked(membership, integrity_fields={"unique_user_tenant": field})
    audit_record(actor=actor, action="membership.create", obj=membership, tenant_id=tenant.pk,
                 after={"user": user.username, "role": role})
    return membership


# A booking is at most a year ahead and cannot outlast its horizon: the longest duration limit (a year and a day).
MAX_DURATION_HOURS = 24 * 366


def quota_duration_error(hours: Any) -> str | None:
    """Why a quota cannot have this max_duration_hours (None: no limit), or None; the admin's forms ask too."""
    if hours is None:
        return None
    if isinstance(hours, bool) or not isinstance(hours, int) or not 1 <= hours <= MAX_DURATION_HOURS:
        return f"At least 1 and at most {MAX_DURATION_HOURS} hours (a year and a day); leave it empty for no limit."
    return None


def _check_duration(values: dict[str, Any], *, current: Quota | None = None) -> None:
    """Refuse a max_duration_hours the quota rule does not allow. With current (the quota, locked): only a new
    value is judged; one saved before the rule (the admin took up to 2^31-1 hours) and sent back unchanged
    stands, so it does not block changing the quota's other numbers."""
    if current is not None and values.get("max_duration_hours", current.max_duration_hours) == \
            current.max_duration_hours:
        return
    why = quota_duration_error(values.get("max_duration_hours"))
    if why:
        raise InvalidInput(f"max_duration_hours: {why[0].lower()}{why[1:]}", fields={"max_duration_hours": why})


@transaction.atomic(durable=True)
def quota_create(
    *, actor, tenant: Tenant, pool: Any, max_nodes: int, burst_nodes: int = 0, max_duration_hours: int | None = None
) -> Quota:
    _check_duration({"max_duration_hours": max_duration_hours})
    quota = Quota(tenant=tenant, pool=pool, max_nodes=max_nodes, burst_nodes=burst_nodes,
                  max_duration_hours=max_duration_hours)
    quota._change_reason = "quota_create"
    _save_checked(quota, integrity_fields={"unique_tenant_pool": "pool"})
    audit_record(actor=actor, action="quota.create", obj=quota, tenant_id=tenant.pk,
                 after=_snapshot(quota, QUOTA_FIELDS))
    return quota


def _locked_quota(pk: int) -> Quota:
    """The quota row, locked; NotFound when it is gone (deleted by a change this one waited for)."""
    quota = Quota.objects.select_for_update().filter(pk=pk).first()
    if quota is None:
        raise NotFound("No such quota (it has just been deleted).")
    return quota


def quota_update(*, actor, quota: Quota, expected_version: str | None = None, **changes: Any) -> Quota:
    """Change quota numbers under the same row lock bookings take, so no booking sees a half-update.

    expected_version (selectors.quota_version, as an edit form was rendered with): when given, the change
    is refused (InvalidState) if the quota was saved since, checked under the lock, so a stale form never
    writes the numbers it showed over a newer edit.
    """
    with transaction.atomic(durable=True):
        quota = _locked_quota(quota.pk)
        _check_duration(changes, current=quota)
        if expected_version is not None and quota_version(quota) != expected_version:
            raise InvalidState(
                f"The quota {quota.tenant}/{quota.pool} was changed since you opened it (now max nodes "
                f"{quota.max_nodes}, burst nodes {quota.burst_nodes}, max duration "
                f"{quota.max_duration_hours or 'none'}); reload it and make your change again.",
                fields={"version": "Out of date."})
        before = _snapshot(quota, QUOTA_FIELDS)
        for key in QUOTA_FIELDS:
            if key in changes:
                setattr(quota, key, changes[key])
        after = _snapshot(quota, QUOTA_FIELDS)
        if after == before:
            return quota  # nothing changed: no save (its version stays), no audit row, as quota_bulk_update
        _save_checked(quota, integrity_fields={})
        audit_record(actor=actor, action="quota.update", obj=quota, tenant_id=quota.tenant_id,
                     before=before, after=after)
    return quota


MAX_TOKEN_DAYS = 3650


def token_issue(*, user: Any, name: str = "", expires_in_days: int | None = None,
                actor: Any = None) -> tuple[ApiToken, str]:
    """Create a token (valid for expires_in_days, else until revoked) and return it with its plaintext,
    which is never stored. Audited (prefix, owner, expiry), never the key."""
    from datetime import timedelta

    from django.utils import timezone

    if expires_in_days is not None and not (isinstance(expires_in_days, int) and 1 <= expires_in_days
                                            <= MAX_TOKEN_DAYS):
        raise InvalidInput(f"expires_in_days: a whole number of days from 1 to {MAX_TOKEN_DAYS}.",
                           fields={"expires_in_days": f"From 1 to {MAX_TOKEN_DAYS}."})
    key = "gpp_" + secrets.token_urlsafe(32)
    expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
    with transaction.atomic():
        token = ApiToken.objects.create(user=user, name=(name or "")[:100], prefix=key[:12],
                                        key_hash=ApiToken.hash_key(key), expires_at=expires_at)
        audit_record(actor=actor, action="token.issue", obj=token,
                     after={"user": user.get_username(), "name": token.name, "prefix": token.prefix,
                            "expires_at": expires_at.isoformat() if expires_at else None})
    return token, key


@transaction.atomic(durable=True)
def token_revoke(*, actor: Any, token: ApiToken) -> ApiToken:
    """Revoke a token: every request presenting it from now on is refused (401). Idempotent; audited."""
    token = ApiToken.objects.select_for_update().select_related("user").filter(pk=token.pk).first()
    if token is None:
        raise NotFound("No such token (its account has just been deleted).")
    if token.revoked:
        return token
    token.revoked = True
    token.save(update_fields=["revoked"])
    audit_record(actor=actor, action="token.revoke", obj=token, before={"revoked": False},
                 after={"revoked": True, "user": token.user.get_username(), "prefix": token.prefix})
    return token


# --- admin and notification settings (appended) -------------------------------------------

__all__ += [
    "quota_bulk_update",
    "quota_delete",
    "membership_update",
    "membership_delete",
    "tenant_slack_webhook_set",
]


def quota_bulk_update(*, actor, changes: list[tuple[Any, dict[str, Any]]], reason: str = "bulk edit",
                      expected: dict[int, dict[str, Any]] | None = None) -> list[Quota]:
    """Apply several quota edits in one transaction, each audited (who, old → new) like quota_update.

    changes is [(quota or its id, {field: value})]. The rows are locked in id order, the same
    lock bookings take, so no booking sees some rows changed and others not, and two bulk
    edits cannot deadlock. Any invalid row rolls the whole batch back.

    expected ({quota id: {field: value}}, what an edit page showed): a row whose numbers are no longer
    those, checked under the lock, refuses the whole batch (InvalidState), so a stale page never writes
    what it showed over a newer edit.
    """
    wanted = {getattr(q, "pk", q): values for q, values in changes}
    updated: list[Quota] = []
    with transaction.atomic(durable=True):
        for quota in Quota.objects.select_for_update().filter(pk__in=list(wanted)).order_by("pk"):
            values = wanted[quota.pk]
            _check_duration(values, current=quota)
            before = _snapshot(quota, QUOTA_FIELDS)
            shown = (expected or {}).get(quota.pk)
            if shown is not None and any(before[key] != value for key, value in shown.items()):
                raise InvalidState(
                    f"The quota {quota.tenant}/{quota.pool} was changed since you opened the list (now max nodes "
                    f"{quota.max_nodes}, burst nodes {quota.burst_nodes}, max duration "
                    f"{quota.max_duration_hours or 'none'}); nothing was saved: reload the list and make your "
                    "changes again.", fields={"quota": "Out of date."})
            for key in QUOTA_FIELDS:
                if key in values:
                    setattr(quota, key, values[key])
            after = _snapshot(quota, QUOTA_FIELDS)
            if after == before:
                continue
            quota._change_reason = reason
            try:
                _save_checked(quota, integrity_fields={})
            except InvalidInput as exc:
                raise InvalidInput(f"{quota}: {exc.detail}", fields=exc.fields)
            audit_record(actor=actor, action="quota.update", obj=quota, tenant_id=quota.tenant_id,
                         before=before, after=after)
            updated.append(quota)
        missing = set(wanted) - {q.pk for q in Quota.objects.filter(pk__in=list(wanted))}
        if missing:
            raise InvalidInput(f"Unknown quota ids: {sorted(missing)}.", fields={"quota": "Unknown."})
    return updated


@transaction.atomic(durable=True)
def quota_delete(*, actor, quota: Quota) -> None:
    """Remove a quota row: the tenant can no longer book that pool (existing bookings stay)."""
    quota = _locked_quota(quota.pk)
    audit_record(actor=actor, action="quota.delete", obj=quota, tenant_id=quota.tenant_id,
                 before=_snapshot(quota, QUOTA_FIELDS))
    quota._change_reason = "quota_delete"
    quota.delete()


def _keep_a_lead(membership: Membership) -> None:
    """Refuse to take away a tenant's last lead (nobody could then manage its members, quotas' use,
    notifications). The tenant's lead rows are locked, so two concurrent demotions cannot both pass."""
    if membership.role != Role.LEAD:
        return
    leads = list(Membership.objects.select_for_update(of=("self",)).filter(tenant_id=membership.tenant_id,
                                                                          role=Role.LEAD).values_list("pk", flat=True))
    if leads == [membership.pk]:
        raise InvalidState(f"{membership.user.username} is the tenant's last lead; make another member lead first.")


def _locked_membership(pk: int) -> Membership:
    """The membership row (with its user), locked; NotFound when it is gone (removed by a change this one
    waited for)."""
    membership = Membership.objects.select_for_update(of=("self",)).select_related("user").filter(pk=pk).first()
    if membership is None:
        raise NotFound("No such membership (it has just been removed).")
    return membership


@transaction.atomic(durable=True)
def membership_update(*, actor, membership: Membership, role: str, expected_role: str | None = None) -> Membership:
    """Change a member's role (the admin). expected_role (what an edit page showed): refused (InvalidState) if the
    role is no longer that, checked under the membership's row lock."""
    membership = _locked_membership(membership.pk)
    if expected_role is not None and membership.role != expected_role:
        raise InvalidState(f"{membership.user.username}'s role changed since you opened this page (now "
                           f"{membership.role}); nothing was saved. Reload the page and make your change again.",
                           fields={"role": "Out of date."})
    return _set_role(actor=actor, membership=membership, role=role)


def _set_role(*, actor, membership: Membership, role: str) -> Membership:
    """Change a locked membership's role, keeping the tenant a lead; audited (the admin's and the team page's)."""
    _check_role(role)
    if membership.role == role:
        return membership
    if role != Role.LEAD:
        _keep_a_lead(membership)
    before = {"user": membership.user.username, "role": membership.role}
    membership.role = role
    membership.save(update_fields=["role"])
    audit_record(actor=actor, action="membership.update", obj=membership, tenant_id=membership.tenant_id,
                 before=before, after={"user": membership.user.username, "role": role})
    return membership


@transaction.atomic(durable=True)
def membership_delete(*, actor, membership: Membership) -> None:
    membership = _locked_membership(membership.pk)
    _remove_member(actor=actor, membership=membership)


def _remove_member(*, actor, membership: Membership) -> Membership:
    """Delete a locked membership, keeping the tenant a lead; audited."""
    _keep_a_lead(membership)
    audit_record(actor=actor, action="membership.delete", obj=membership, tenant_id=membership.tenant_id,
                 before={"user": membership.user.username, "role": membership.role})
    membership.delete()
    return membership


def _clean_slack_url(url: Any) -> str:
    """The Slack URL as stored: "" (none), or what portal.core.egress.checked_url accepts."""
    from portal.core.egress import checked_url

    if not str(url or "").strip():
        return ""
    return checked_url(url, field="slack_webhook_url", hint="Give the incoming-webhook URL Slack showed you.")


def tenant_network_check(cidr: str | None) -> str:
    """The network as tenant_create / tenant_update would store it, or InvalidInput: for a form to ask first."""
    return _validate_network(cidr)


def slack_webhook_url_check(url: Any) -> str:
    """The Slack URL as tenant_slack_webhook_set would store it, or InvalidInput: for a form to ask first."""
    return _clean_slack_url(url)


def tenant_slack_webhook_set(*, actor, tenant: Tenant, url: str) -> Tenant:
    """Set (or clear, with "") the tenant's Slack incoming-webhook URL; audited masked, never in full.

    Staff, or one of the tenant's leads, decided under the team lock: a lead demoted or removed while this
    runs cannot point the tenant's notifications at a URL of their choosing."""
    return _slack_webhook_store(actor=actor, tenant=tenant, url=_clean_slack_url(url))  # checked outside: DNS


@transaction.atomic(durable=True)
def _slack_webhook_store(*, actor, tenant: Tenant, url: str) -> Tenant:
    _lock_team(actor=actor, tenant_id=tenant.pk, denied="Only the tenant's lead manages its notifications.")
    return _slack_webhook_write(actor=actor, tenant_id=tenant.pk, url=url)


def tenant_slack_webhook_clear_locked(*, actor: Any, tenant_id: int) -> Tenant:
    """For notifications (deleting the tenant's Slack channel): clear the tenant's Slack URL inside the caller's
    transaction, so that the URL and the channel go together or not at all. The caller has decided actor's
    right under the team lock (tenant_lead_lock) and locked nothing after it: the tenant row comes next.
    Audited as tenant_slack_webhook_set(url="") is; a URL that is not set (any more) is left alone, unaudited."""
    _inside_callers_transaction("tenant_slack_webhook_clear_locked")
    return _slack_webhook_write(actor=actor, tenant_id=tenant_id, url="", unless_unset=True)


def tenant_slack_webhook_set_locked(*, actor: Any, tenant_id: int, url: str) -> Tenant:
    """For notifications (the Slack channel's admin page saving its URL with its events): set the tenant's Slack
    URL inside the caller's transaction, so that the URL and the channel's settings go together or not at all.
    url is what slack_webhook_url_check returned (checked before the transaction: it resolves the host). The
    caller has decided actor's right under the team lock (tenant_lead_lock) and locked nothing after it: the
    tenant row comes next. Audited and announced as tenant_slack_webhook_set is."""
    _inside_callers_transaction("tenant_slack_webhook_set_locked")
    return _slack_webhook_write(actor=actor, tenant_id=tenant_id, url=url)


def _inside_callers_transaction(name: str) -> None:
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError(f"{name} runs inside the caller's transaction")


def _slack_webhook_write(*, actor, tenant_id: int, url: str, unless_unset: bool = False) -> Tenant:
    """Lock the tenant row and write its Slack URL, audited (announced when set); with unless_unset, a URL
    that is not set (any more) is left alone, unaudited."""
    from portal.core.crypto import mask

    # NO KEY UPDATE: the URL is no key, and bookings key-share the row (their burst flag) while holding a
    # membership row this function has locked; FOR UPDATE here could deadlock with a lead's booking.
    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant_id)
    if unless_unset and not tenant.slack_webhook_url:
        return tenant
    before = {"slack_webhook_url": mask(tenant.slack_webhook_url, keep=6)}
    tenant.slack_webhook_url = url
    tenant.save(update_fields=["slack_webhook_url"])
    audit_record(actor=actor, action="tenant.slack_webhook", obj=tenant, tenant_id=tenant.pk,
                 before=before, after={"slack_webhook_url": mask(url, keep=6)})
    if url:
        events.emit(SLACK_WEBHOOK_SET, tenant_id=tenant.pk)
    return tenant


def tenant_rotate_ical_token(*, actor: Any, tenant: Tenant) -> Tenant:
    """Issue a new secret for the tenant's iCalendar feed; the old feed address stops working.

    Staff, or one of the tenant's leads, decided under the team lock: a lead demoted or removed while this
    runs changes no one's address."""
    with transaction.atomic(durable=True):
        _lock_team(actor=actor, tenant_id=tenant.pk,
                   denied="Only the tenant's lead can change the calendar feed address.")
        tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        had_feed = bool(tenant.ical_token)
        tenant.ical_token = secrets.token_urlsafe(24)
        tenant.save(update_fields=["ical_token"])
        audit_record(actor=actor, action="tenant.ical_token_rotate", obj=tenant, tenant_id=tenant.pk,
                     before={"feed": "set" if had_feed else "none"}, after={"feed": "set"})
    return tenant


# --- self-service API tokens (the account page) -------------------------------------------

__all__ += ["token_issue_own", "token_revoke_own", "MAX_LIVE_TOKENS"]

# Live (unrevoked, unexpired) tokens one user may hold: enough for every script and machine,
# few enough that a forgotten one is noticed; revoking one frees a place.
MAX_LIVE_TOKENS = 20


@transaction.atomic(durable=True)
def token_issue_own(*, user: Any, name: str = "", expires_in_days: int | None = None) -> tuple[ApiToken, str]:
    """Issue a token to its own user (the account page), at most MAX_LIVE_TOKENS live at once.

    The user's row is locked first, so two tabs issuing at once cannot both take the last place.
    """
    from .selectors import api_tokens_live

    if not getattr(user, "is_active", False):
        raise PermissionDenied("This account is disabled.")
    if get_user_model().objects.select_for_update().filter(pk=user.pk, is_active=True).values_list(
            "pk", flat=True).first() is None:  # deleted or disabled while this waited on the lock
        raise PermissionDenied("This account is disabled.")
    if api_tokens_live(user=user).count() >= MAX_LIVE_TOKENS:
        raise InvalidState(f"You already have {MAX_LIVE_TOKENS} live API tokens; revoke one you no longer use first.")
    return token_issue(user=user, name=name, expires_in_days=expires_in_days, actor=user)


def token_revoke_own(*, user: Any, token_id: int) -> ApiToken:
    """Revoke one of the user's own tokens; another user's token reads as unknown (404)."""
    token = ApiToken.objects.filter(pk=token_id, user=user).first()
    if token is None:
        raise NotFound("No such token.")
    return token_revoke(actor=user, token=token)


# --- the team page: a tenant's leads manage its members -----------------------------------

__all__ += ["team_member_add", "team_member_set_role", "team_member_remove"]


def _lock_team(*, actor: Any, tenant_id: int,
               denied: str = "Only the tenant's leads (or platform staff) can change its members.") -> None:
    """Check that actor may manage the tenant's members (staff, or one of its leads), holding the answer.

    The tenant's lead rows are locked (FOR UPDATE, in one order: the lock _keep_a_lead takes), so a
    lead being demoted or removed concurrently waits for this change, or this change waits and
    then finds the actor no longer a lead. Two leads demoting each other queue instead of deadlocking.
    """
    leads = list(Membership.objects.select_for_update(of=("self",)).filter(tenant_id=tenant_id, role=Role.LEAD)
                 .order_by("pk").values_list("user_id", flat=True))
    if getattr(actor, "is_staff", False):
        return
    if getattr(actor, "pk", None) not in leads:
        raise PermissionDenied(denied)


def tenant_lead_lock(*, actor: Any, tenant_id: int | None, denied: str) -> None:
    """For other apps' services (notifications): decide that actor is staff or one of the tenant's leads, and hold
    the answer to the end of the caller's transaction (_lock_team's lock, taken first: before the tenant row
    (FOR NO KEY UPDATE) and the caller's own rows, in the order tenants services take them). tenant_id None (a
    platform-wide thing): staff only. Raises PermissionDenied(denied); must run inside a transaction."""
    if tenant_id is None:
        if not getattr(actor, "is_staff", False):
            raise PermissionDenied(denied)
        return
    _lock_team(actor=actor, tenant_id=tenant_id, denied=denied)


def _team_membership(*, tenant: Tenant, membership_id: int) -> Membership:
    membership = (Membership.objects.select_for_update(of=("self",)).select_related("user")
                  .filter(pk=membership_id, tenant=tenant).first())
    if membership is None:
        raise NotFound("No such member of this tenant.")
    return membership


def _check_role(role: str) -> None:
    if role not in Role.values:
        raise InvalidInput("role: unknown role.", fields={"role": f"One of {', '.join(Role.values)}."})


@transaction.atomic(durable=True)
def team_member_add(*, actor: Any, tenant: Tenant, username: str, role: str = Role.MEMBER) -> Membership:
    """Add an existing, active user to the tenant (a lead or staff)."""
    user = _lock_account(username=(username or "").strip())  # refused below only after the rights check
    _lock_team(actor=actor, tenant_id=tenant.pk)
    _check_role(role)
    if user is None:
        raise InvalidInput("username: no active user by that name.",
                           fields={"username": "No active user by that name; platform staff create accounts."})
    current = Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()
    if current is not None:  # (one added concurrently still meets the unique constraint in _add_member)
        text = (f"{user.username} is already a member of {tenant.name} (as {current}); "
                "change their role in the members list instead.")
        raise InvalidInput(f"username: {text}", fields={"username": text})
    return _add_member(actor=actor, tenant=tenant, user=user, role=role, field="username")


@transaction.atomic(durable=True)
def team_member_set_role(*, actor: Any, tenant: Tenant, membership_id: int, role: str) -> Membership:
    """Change a member's role (a lead or staff); the tenant always keeps a lead."""
    _lock_team(actor=actor, tenant_id=tenant.pk)
    _check_role(role)
    return _set_role(actor=actor, membership=_team_membership(tenant=tenant, membership_id=membership_id), role=role)


@transaction.atomic(durable=True)
def team_member_remove(*, actor: Any, tenant: Tenant, membership_id: int) -> Membership:
    """Take a member out of the tenant (a lead or staff); the tenant always keeps a lead.

    Their reservations stay (the tenant's), and their personal calendar feed stops working.
    """
    _lock_team(actor=actor, tenant_id=tenant.pk)
    return _remove_member(actor=actor, membership=_team_membership(tenant=tenant, membership_id=membership_id))
