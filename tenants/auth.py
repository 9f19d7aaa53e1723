"""Bearer-token authentication against hashed ApiToken rows."""

from __future__ import annotations

from django.utils import timezone
from rest_framework import authentication, exceptions

from .models import ApiToken


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
        # key_hash is unique: get() reads at most one row with no ORDER BY.
        try:
            token = ApiToken.objects.select_related("user").get(key_hash=ApiToken.hash_key(key), revoked=False)
        except ApiToken.DoesNotExist:
            token = None
        now = timezone.now()
        if token is None or not token.user.is_active or (token.expires_at and token.expires_at <= now):
            raise exceptions.AuthenticationFailed("Invalid or expired token.")
        # Touch last_used_at at most once a minute: a write per request would serialise scripts.
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request):
        return f'{self.keyword} realm="api"'
