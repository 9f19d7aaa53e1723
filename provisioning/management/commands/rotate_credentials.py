"""`manage.py rotate_credentials`: re-encrypt every stored secret with the first of PORTAL_FERNET_KEYS.

Rotation: put the new key first in PORTAL_FERNET_KEYS (keep the old ones after it), deploy,
run this, then drop the old keys.
"""

from django.core.management.base import BaseCommand

from provisioning.services import credentials_rotate


class Command(BaseCommand):
    help = "Re-encrypt all cluster credentials with the primary Fernet key."

    def handle(self, *args, **options):
        count = credentials_rotate()
        self.stdout.write(f"re-encrypted {count} credential(s)")
