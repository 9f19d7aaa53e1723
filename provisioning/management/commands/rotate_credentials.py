"""`manage.py rotate_credentials`: re-encrypt every stored secret with the first of PORTAL_FERNET_KEYS.

Rotation: put the new key first in PORTAL_FERNET_KEYS (keep the old ones after it), deploy,
run this, then drop the old keys.
"""

from django.core.management.base import BaseCommand

from portal.core.crypto import rotate_encrypted_columns
from provisioning.services import credentials_rotate


class Command(BaseCommand):
    help = "Re-encrypt all stored secrets (cluster credentials, webhook URLs and secrets) with the primary key."

    def handle(self, *args, **options):
        count = credentials_rotate()
        fields = rotate_encrypted_columns()
        self.stdout.write(f"re-encrypted {count} credential(s) and {fields} other secret(s)")
