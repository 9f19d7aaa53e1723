from django.core.management.base import BaseCommand, CommandError

from portal.core.cli import storable_text
from tenants.models import ApiToken
from tenants.services import token_revoke


class Command(BaseCommand):
    help = ("Revoke API tokens: by the prefix issue_token printed (e.g. gpp_AbC123xy), or all of a user's "
            "with --user. Requests presenting them are refused from now on.")

    def add_arguments(self, parser):
        parser.add_argument("prefix", nargs="?", help="the token's first 12 characters, as listed in the admin")
        parser.add_argument("--user", help="revoke every token of this user instead")

    def handle(self, *args, prefix, user, **options):
        if bool(prefix) == bool(user):
            raise CommandError("Give a token prefix or --user USERNAME (one of the two).")
        prefix, user = storable_text(prefix, what="prefix"), storable_text(user, what="--user")
        tokens = ApiToken.objects.filter(revoked=False).select_related("user")
        tokens = tokens.filter(user__username=user) if user else tokens.filter(prefix=prefix[:12])
        found = list(tokens)
        if not found:
            raise CommandError("No such live token.")
        for token in found:
            token_revoke(actor=None, token=token)
            self.stdout.write(f"revoked {token.prefix}… ({token.user.get_username()}, {token.name or 'unnamed'})")
