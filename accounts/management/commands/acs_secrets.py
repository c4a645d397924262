"""Print freshly generated SECRET_KEY, API_KEY_HMAC_SECRET and PLAYGROUND_KEY_ENCRYPTION_KEY
lines in .env format (see `accounts.secret_generation`, which prints the same without Django,
for a machine whose settings do not load yet)."""

from django.core.management.base import BaseCommand

from accounts.secret_generation import env_lines


class Command(BaseCommand):
    help = "Print new SECRET_KEY, API_KEY_HMAC_SECRET and PLAYGROUND_KEY_ENCRYPTION_KEY lines."

    def handle(self, *args, **options):
        self.stdout.write(env_lines())
