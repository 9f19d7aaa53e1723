from django.db import models


class Role(models.TextChoices):
    LEAD = "lead", "Lead"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


BOOKING_ROLES = frozenset({Role.LEAD, Role.MEMBER})
