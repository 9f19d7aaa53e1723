"""`manage.py rotate_credentials`: re-encrypt every stored secret with the first of PORTAL_FERNET_KEYS.

Rotation: put the new key first in PORTAL_FERNET_KEYS (keep the old ones after it), deploy,
run this, then drop the old keys. A secret no listed key decrypts is left as stored and named, the others
are still re-encrypted, and the command exits non-zero: do not drop a key before it succeeds.
"""

from django.core.management.base import BaseCommand, CommandError
from django.template.defaultfilters import pluralize

from portal.core.crypto import rotate_encrypted_columns
from provisioning.services import credentials_rotate


class Command(BaseCommand):
    help = "Re-encrypt all stored secrets (cluster credentials, webhook URLs and secrets) with the primary key."

    def handle(self, *args, **options):
        count, unreadable = credentials_rotate()
        fields, fields_unreadable = rotate_encrypted_columns()
        self.stdout.write(f"re-encrypted {count} credential{pluralize(count)} "
                          f"and {fields} other secret{pluralize(fields)}")
        # Left as stored, and named: dropping the old keys now would lose them (put their key back, run again).
        problems = []
        if unreadable:
            problems.append(f"{len(unreadable)} credential{pluralize(len(unreadable))} no key decrypts "
                            "(left as stored): " + ", ".join(f"#{pk}" for pk in unreadable))
        if fields_unreadable:
            problems.append(f"{fields_unreadable} other secret{pluralize(fields_unreadable)} no key decrypts "
                            "(left as stored; see the log)")
        if problems:
            raise CommandError("; ".join(problems))
