"""DRF plug-ins named in settings (kept apart from views so importing them never cycles)."""

from rest_framework import pagination

from .throttle import RedisRateThrottle

__all__ = ["Pagination", "UserThrottle", "AnonThrottle"]


class Pagination(pagination.PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 500


class UserThrottle(RedisRateThrottle):
    """PORTAL_THROTTLE_USER per signed-in user (token or session), across every web process."""

    scope = "user"
    setting_name = "PORTAL_THROTTLE_USER"

    def ident(self, request) -> str | None:
        user = getattr(request, "user", None)
        return str(user.pk) if user is not None and user.is_authenticated else None


class AnonThrottle(RedisRateThrottle):
    """PORTAL_THROTTLE_ANON per client address for requests without credentials."""

    scope = "anon"
    setting_name = "PORTAL_THROTTLE_ANON"

    def ident(self, request) -> str | None:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return None
        return self.get_ident(request)
