from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from tenants.services import token_issue


class Command(BaseCommand):
    help = "Issue an API token for USERNAME; the token is the last line of the output."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")

    def handle(self, *args, username, name, **options):
        try:
            user = get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"No user named {username!r}.")
        token, key = token_issue(user=user, name=name)
        self.stderr.write(f"Token {token.prefix}… for {username} (stored hashed; shown once):")
        self.stdout.write(key)
