"""HTML forms for signing in, switching tenant and choosing a time zone."""

from __future__ import annotations

import hashlib
import logging
import time
import zoneinfo
from functools import lru_cache

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache
from redis.exceptions import RedisError
from rest_framework.throttling import BaseThrottle

from portal.core.conf import setting_int
from portal.core.words import count_of

from .choices import Role
from .models import Tenant

__all__ = [
    "LockoutAuthenticationForm",
    "LockoutAdminAuthenticationForm",
    "client_ip",
    "TenantSwitchForm",
    "TimeZoneForm",
    "login_lock_remaining",
    "valid_time_zone",
    "time_zone_choices",
]

logger = logging.getLogger(__name__)

# Defaults; a deployment overrides them in settings or the environment (read per request, never at import).
LOGIN_MAX_FAILURES = 5  # per username within the window
LOGIN_MAX_FAILURES_PER_IP = 30  # one address guessing many usernames
LOGIN_WINDOW_SECONDS = 15 * 60
LOGIN_LOCKOUT_SECONDS = 15 * 60


def _setting(name: str, default: int) -> int:
    return setting_int(name, default)


@lru_cache(maxsize=1)
def _zones() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def valid_time_zone(name: str | None) -> str | None:
    """Return name if it is a known IANA zone, else None (never trust a browser-sent string)."""
    if name and name in _zones():
        return name
    return None


def time_zone_choices() -> list[tuple[str, str]]:
    return [(z, z.replace("_", " ")) for z in sorted(_zones()) if "/" in z or z == "UTC"]


# --- sign-in lockout (Redis cache: shared by every web process) ---------------------------


def _key(kind: str, value: str) -> str:
    # Hash so odd usernames never form odd cache keys.
    return f"login:{kind}:" + hashlib.sha256(value.encode()).hexdigest()[:32]


def client_ip(request) -> str:
    """The client's address as the API throttles tell clients apart (DRF's NUM_PROXIES, from PORTAL_NUM_PROXIES).

    REMOTE_ADDR, or behind that many trusted proxies the address the last of them appended to
    X-Forwarded-For; never the header as the client sent it, which anyone can fill with a fresh
    address per request. Behind the TLS proxy REMOTE_ADDR is the proxy's, shared by everyone.
    """
    return BaseThrottle().get_ident(request)


def _subjects(username: str, ip: str) -> list[tuple[str, str, int]]:
    return [
        ("user", username.strip().lower(), _setting("PORTAL_LOGIN_MAX_FAILURES", LOGIN_MAX_FAILURES)),
        ("ip", ip or "unknown", _setting("PORTAL_LOGIN_MAX_FAILURES_PER_IP", LOGIN_MAX_FAILURES_PER_IP)),
    ]


def login_lock_remaining(username: str, ip: str) -> int:
    """Return the seconds left on a lockout of this username or address (0 when not locked)."""
    now = time.time()
    try:
        until = max(
            (cache.get(_key(f"lock-{kind}", value)) or 0) for kind, value, _limit in _subjects(username, ip)
        )
    except RedisError:
        # As the API throttle does (portal.core.throttle): Redis down lets the request through, logged;
        # a sign-in page answering 500 to everyone is no protection either (/readyz reports Redis).
        logger.warning("sign-in lockout not checked: the cache (Redis) is unreachable", exc_info=True)
        return 0
    return max(0, int(until - now))


def _reserve_attempt(username: str, ip: str) -> list[tuple[str, int, int]] | None:
    """Count this attempt as a failure before its password is checked; None when it is one too many.

    Counting first makes the limit hold under parallel guesses: with the count taken after the
    (slow) password check, every request already past the lock check when the limit was reached
    got its guess. Returns (key, count, limit) per subject for _settle_attempt.
    """
    window = _setting("PORTAL_LOGIN_WINDOW_SECONDS", LOGIN_WINDOW_SECONDS)
    taken: list[tuple[str, int, int]] = []
    try:
        for kind, value, limit in _subjects(username, ip):
            key = _key(f"fail-{kind}", value)
            cache.add(key, 0, timeout=window)
            try:
                count = cache.incr(key)
            except ValueError:  # expired between add and incr
                cache.set(key, 1, timeout=window)
                count = 1
            taken.append((key, count, limit))
            if count > limit:  # the limit's worth of guesses are spent or still being checked
                _release(taken)
                return None
    except RedisError:
        logger.warning("sign-in attempt not counted: the cache (Redis) is unreachable", exc_info=True)
        _release(taken)
        return []
    return taken


def _release(taken: list[tuple[str, int, int]]) -> None:
    """Take back the attempts counted in advance (not a guess after all)."""
    for key, _count, _limit in taken:
        try:
            cache.decr(key)
        except ValueError:  # gone meanwhile: a success cleared it, a lock reset it, or it expired
            pass
        except RedisError:
            logger.warning("sign-in attempt not taken back: the cache (Redis) is unreachable", exc_info=True)


def _settle_failure(username: str, ip: str, taken: list[tuple[str, int, int]]) -> None:
    """A wrong password: the attempt stays counted; the one that reaches the limit locks the subject."""
    lockout = _setting("PORTAL_LOGIN_LOCKOUT_SECONDS", LOGIN_LOCKOUT_SECONDS)
    for (kind, value, _limit), (key, count, limit) in zip(_subjects(username, ip), taken, strict=False):
        if count >= limit:
            try:
                cache.set(_key(f"lock-{kind}", value), time.time() + lockout, timeout=lockout)
                cache.delete(key)
            except RedisError:
                logger.warning("sign-in lock not set: the cache (Redis) is unreachable", exc_info=True)
                continue
            logger.warning("sign-in locked for %s %s after %d failures", kind, value, count)


def _clear_failures(username: str) -> None:
    try:
        cache.delete(_key("fail-user", username.strip().lower()))
    except RedisError:
        logger.warning("sign-in failures not cleared: the cache (Redis) is unreachable", exc_info=True)


class LockoutMixin:
    """Refuse a username (or address) for a while after repeated failures.

    The lock is checked before the password, so a correct guess during the lockout still fails.
    Shared by the portal's sign-in and the admin's: both count towards, and honour, one lock.
    """

    error_messages = {
        **AuthenticationForm.error_messages,
        "locked": "Too many failed sign-in attempts. Try again in %(wait)s.",
    }

    def clean(self):
        username = self.cleaned_data.get("username") or ""
        ip = client_ip(self.request) if self.request else ""
        remaining = login_lock_remaining(username, ip)
        taken = None if remaining else _reserve_attempt(username, ip)
        if taken is None:
            self.locked = True
            seconds = remaining or _setting("PORTAL_LOGIN_LOCKOUT_SECONDS", LOGIN_LOCKOUT_SECONDS)
            wait = count_of(max(1, -(-seconds // 60)), "minute")
            raise forms.ValidationError(self.error_messages["locked"], code="locked", params={"wait": wait})
        try:
            cleaned = super().clean()
        except forms.ValidationError as exc:
            # A wrong password only: the admin's form also says "invalid_login" to a non-staff user whose
            # password was right (user_cache set), and that is no guess to count against the account.
            if exc.code == "invalid_login" and getattr(self, "user_cache", None) is None:
                _settle_failure(username, ip, taken)
            else:
                _release(taken)
            raise
        except BaseException:
            _release(taken)
            raise
        _release(taken)
        _clear_failures(username)
        return cleaned

    @property
    def is_locked(self) -> bool:
        return getattr(self, "locked", False)


class LockoutAuthenticationForm(LockoutMixin, AuthenticationForm):
    """Django's sign-in form with the lockout, and the browser's time zone."""

    tz = forms.CharField(required=False, widget=forms.HiddenInput)


class LockoutAdminAuthenticationForm(LockoutMixin, AdminAuthenticationForm):
    """The admin's sign-in form (staff only) with the same lockout."""

    error_messages = {**AdminAuthenticationForm.error_messages, **LockoutMixin.error_messages,
                      "invalid_login": AdminAuthenticationForm.error_messages["invalid_login"]}


class TenantSwitchForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(), to_field_name="slug", label="Tenant")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        # Only tenants the user may see: a foreign slug is simply "not a valid choice".
        self.fields["tenant"].queryset = Tenant.objects.for_user(user)


class TimeZoneForm(forms.Form):
    tz = forms.ChoiceField(label="Time zone", choices=())

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tz"].choices = time_zone_choices()


class ApiTokenForm(forms.Form):
    """A personal API token (the account page): a name to recognise it by, and how long it lives."""

    EXPIRY_CHOICES = [("30", "30 days"), ("90", "90 days"), ("365", "1 year"), ("never", "No expiry (until revoked)")]

    name = forms.CharField(label="Name", max_length=100, required=False,
                           help_text="What uses it, e.g. “nightly training script”.")
    expires = forms.ChoiceField(label="Expires after", choices=EXPIRY_CHOICES, initial="90")

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if any(ord(ch) < 32 for ch in name):
            raise forms.ValidationError("No control characters, please.")
        return name

    @property
    def expires_in_days(self) -> int | None:
        value = self.cleaned_data["expires"]
        return None if value == "never" else int(value)


class TeamAddForm(forms.Form):
    """Add an existing user to the current tenant (the team page)."""

    username = forms.CharField(label="Username", max_length=150)
    role = forms.ChoiceField(label="Role", choices=Role.choices, initial=Role.MEMBER)


class TeamRoleForm(forms.Form):
    role = forms.ChoiceField(label="Role", choices=Role.choices)
