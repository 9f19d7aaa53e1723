"""DRF plug-ins named in settings (kept apart from views so importing them never cycles)."""

from django.conf import settings
from rest_framework import pagination, throttling

__all__ = ["Pagination", "UserThrottle", "AnonThrottle"]


class Pagination(pagination.PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 500


class _SettingsRateMixin:
    """Read the rate from settings on each request, so the environment (and tests) can set it."""

    setting_name = ""

    def get_rate(self) -> str:
        return getattr(settings, self.setting_name)


class UserThrottle(_SettingsRateMixin, throttling.UserRateThrottle):
    setting_name = "PORTAL_THROTTLE_USER"


class AnonThrottle(_SettingsRateMixin, throttling.AnonRateThrottle):
    setting_name = "PORTAL_THROTTLE_ANON"
