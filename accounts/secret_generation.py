"""Fresh production secrets in .env format, without Django: with DEBUG off the settings refuse
to load until these secrets exist, so the first ones come from

    python -m accounts.secret_generation > secrets.env

(`manage.py acs_secrets` prints the same where the settings already load.)

SECRET_KEY signs sessions and CSRF tokens, API_KEY_HMAC_SECRET keys the hash of API keys (so a
leaked SECRET_KEY cannot check guessed keys), PLAYGROUND_KEY_ENCRYPTION_KEY is the Fernet key
that encrypts playground key secrets at rest. Every replica of web, worker and beat needs the
same three values. Generate them once per deployment: a new API_KEY_HMAC_SECRET invalidates
every API key, a new Fernet key makes the stored playground key secrets undecryptable.
"""

import secrets

from cryptography.fernet import Fernet


def generated_secrets() -> dict[str, str]:
    return {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "API_KEY_HMAC_SECRET": secrets.token_urlsafe(48),
        "PLAYGROUND_KEY_ENCRYPTION_KEY": Fernet.generate_key().decode(),
    }


def env_lines() -> str:
    return "\n".join(f"{name}={value}" for name, value in generated_secrets().items())


if __name__ == "__main__":
    print(env_lines())
