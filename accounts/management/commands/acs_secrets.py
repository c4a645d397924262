"""Print freshly generated production secrets in .env format:

    python manage.py acs_secrets >> /etc/acs-portal.env

SECRET_KEY signs sessions and CSRF tokens, API_KEY_HMAC_SECRET keys the hash of API keys (so a
leaked SECRET_KEY cannot check guessed keys), PLAYGROUND_KEY_ENCRYPTION_KEY is the Fernet key
that encrypts playground key secrets at rest. Every replica of web, worker and beat needs the
same three values. Generate them once per deployment: a new API_KEY_HMAC_SECRET invalidates
every API key, a new Fernet key makes the stored playground key secrets undecryptable.
"""

import secrets

from cryptography.fernet import Fernet
from django.core.management.base import BaseCommand


def generated_secrets() -> dict[str, str]:
    return {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "API_KEY_HMAC_SECRET": secrets.token_urlsafe(48),
        "PLAYGROUND_KEY_ENCRYPTION_KEY": Fernet.generate_key().decode(),
    }


class Command(BaseCommand):
    help = "Print new SECRET_KEY, API_KEY_HMAC_SECRET and PLAYGROUND_KEY_ENCRYPTION_KEY lines."

    def handle(self, *args, **options):
        for name, value in generated_secrets().items():
            self.stdout.write(f"{name}={value}")
