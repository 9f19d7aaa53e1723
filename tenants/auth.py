"""Bearer-token authentication against hashed ApiToken rows."""

from __future__ import annotations

import logging
from datetime import timedelta

import redis
from django.conf import settings
from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.throttling import BaseThrottle

from portal.core.statements import CompiledLookup
from portal.core.throttle import acquire, budget_key, parse_rate, peek, redis_client

from .models import ApiToken

_TOUCH_EVERY = timedelta(seconds=60)

# Every API request runs this one query shape: compiled by the ORM once per thread, bound per request.
_TOKEN = CompiledLookup(str)

logger = logging.getLogger(__name__)

# Failed Bearer authentications are counted per client address (PORTAL_THROTTLE_BAD_TOKEN): past the limit
# the address is answered 429 before its token is looked up. A token this process has served is let through
# to the lookup without asking Redis (the valid path costs no extra round trip), so a flood of bad tokens from
# an address does not shut out a token that address was using; a token this process has not served yet (a
# new one, a fresh process) is refused with the flood until the address's budget refills.
_SERVED_MAX = 10_000
_served: set[str] = set()  # key hashes this process answered; cleared whole when full


def _failure_budget(request):
    rate_setting = getattr(settings, "PORTAL_THROTTLE_BAD_TOKEN", "")
    if not rate_setting:
        return None
    rate = parse_rate(rate_setting)
    return budget_key("bad_token", rate, BaseThrottle().get_ident(request)), rate


def _bad_token_wait(request, *, spend: bool) -> float:
    """Seconds this address must wait, its failed-authentication budget spent (0: it may go on); spend counts one
    failure. Redis down: nothing is counted and nothing refused (logged)."""
    budget = _failure_budget(request)
    if budget is None:
        return 0.0
    try:
        return (acquire if spend else peek)(redis_client(), *budget)
    except (redis.RedisError, OSError) as exc:
        logger.warning("bad-token throttle not applied: Redis unavailable (%s)", exc)
        return 0.0


def _over_the_limit(request) -> None:
    """429 when this address has spent its failed-authentication budget; counts nothing."""
    if wait := _bad_token_wait(request, spend=False):
        raise exceptions.Throttled(wait)


def _refuse(request, message: str):
    """Count one failed authentication against the address: 401, or 429 once past its budget."""
    if wait := _bad_token_wait(request, spend=True):
        raise exceptions.Throttled(wait)
    raise exceptions.AuthenticationFailed(message)


def _token_by_hash(key_hash):
    return ApiToken.objects.select_related("user").filter(key_hash=key_hash, revoked=False)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            _refuse(request, "Malformed Authorization header; use 'Bearer <token>'.")
        try:
            key = header[1].decode()
        except UnicodeError:
            _refuse(request, "Invalid token.")
        key_hash = ApiToken.hash_key(key)
        if key_hash not in _served:
            _over_the_limit(request)
        # key_hash is unique: at most one row, read with no ORDER BY.
        token = _TOKEN.get(_token_by_hash, key_hash, shape="token")
        now = timezone.now()
        if token is None or not token.user.is_active or (token.expires_at and token.expires_at <= now):
            _served.discard(key_hash)
            _refuse(request, "Invalid or expired token.")
        # Touch last_used_at at most once a minute: a write per request would serialise scripts. The
        # condition is repeated in the UPDATE, so of concurrent requests only the first writes, and one that
        # waited on the row while a later use was recorded does not move it back to its earlier reading.
        # The UPDATE may wait on the row behind a revocation: when it touched nothing, the row is read again,
        # and a token revoked (or deleted with its user) meanwhile is refused, not served.
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() > _TOUCH_EVERY.total_seconds():
            touched = (ApiToken.objects.filter(pk=token.pk, revoked=False)
                       .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - _TOUCH_EVERY))
                       .update(last_used_at=now))
            if not touched and not ApiToken.objects.filter(pk=token.pk, revoked=False).exists():
                _served.discard(key_hash)
                _refuse(request, "Invalid or expired token.")
        if key_hash not in _served:
            if len(_served) >= _SERVED_MAX:
                _served.clear()
            _served.add(key_hash)
        return token.user, token

    def authenticate_header(self, request):
        return f'{self.keyword} realm="api"'
