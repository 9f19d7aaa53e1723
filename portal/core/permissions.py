from rest_framework import permissions


class StaffWritePermission(permissions.BasePermission):
    """Any signed-in user may read; only staff may write."""

    message = "Only platform staff can change this."

    def has_permission(self, request, view):
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in permissions.SAFE_METHODS or request.user.is_staff


class StaffOnlyPermission(permissions.BasePermission):
    message = "Only platform staff can do this."

    def has_permission(self, request, view):
        return bool(request.user and request.user.is_authenticated and request.user.is_staff)
