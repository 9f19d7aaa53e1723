"""Bearer-token authentication against hashed ApiToken rows."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions

from portal.core.statements import CompiledLookup

from .models import ApiToken

_TOUCH_EVERY = timedelta(seconds=60)

# Every API request runs this one query shape: compiled by the ORM once per thread, bound per request.
_TOKEN = CompiledLookup(str)


def _token_by_hash(key_hash):
    return ApiToken.objects.select_related("user").filter(key_hash=key_hash, revoked=False)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header; use 'Bearer <token>'.")
        try:
            key = header[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("Invalid token.")
        # key_hash is unique: at most one row, read with no ORDER BY.
        token = _TOKEN.get(_token_by_hash, ApiToken.hash_key(key), shape="token")
        now = timezone.now()
        if token is None or not token.user.is_active or (token.expires_at and token.expires_at <= now):
            raise exceptions.AuthenticationFailed("Invalid or expired token.")
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
                raise exceptions.AuthenticationFailed("Invalid or expired token.")
        return token.user, token

    def authenticate_header(self, request):
        return f'{self.keyword} realm="api"'
