from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from portal.core.cli import storable_text
from portal.core.exceptions import DomainError
from tenants.services import token_issue


class Command(BaseCommand):
    help = "Issue an API token for USERNAME; the token is the last line of the output."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")
        parser.add_argument("--expires-in-days", type=int, default=None,
                            help="valid for this many days (default: until revoked with revoke_token)")

    def handle(self, *args, username, name, expires_in_days, **options):
        username, name = storable_text(username, what="username"), storable_text(name, what="--name")
        try:
            user = get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"No user named {username!r}.")
        if not user.is_active:
            # Bearer authentication refuses every token of a disabled account: printing one would hand out a 401.
            raise CommandError(f"User {username!r} is disabled; enable the account first (its tokens are refused).")
        try:
            token, key = token_issue(user=user, name=name, expires_in_days=expires_in_days)
        except DomainError as exc:
            raise CommandError(exc.detail)
        until = f", valid until {token.expires_at:%Y-%m-%d %H:%M}Z" if token.expires_at else ""
        self.stderr.write(f"Token {token.prefix}… for {username}{until} (stored hashed; shown once):")
        self.stdout.write(key)
