"""The managed playground key: the user's API key that the playground's workers call /v1
with, its secret stored encrypted."""

from cryptography.fernet import Fernet
from django.conf import settings
from django.db import transaction

from accounts.models import ApiKey, User
from accounts.services.keys import api_key_create

PLAYGROUND_KEY_NAME = "Playground"


def _fernet() -> Fernet:
    return Fernet(settings.PLAYGROUND_KEY_ENCRYPTION_KEY.encode())


def playground_key_secret(key: ApiKey) -> str:
    """Decrypt a playground key's stored secret."""
    return _fernet().decrypt(key.encrypted_secret.encode()).decode()


def playground_key_get_or_create(*, user: User) -> tuple[ApiKey, str]:
    """The user's playground key and its secret, creating the key on first use.

    The secret is stored encrypted (Fernet, `PLAYGROUND_KEY_ENCRYPTION_KEY`); it is decrypted
    here, so call this only where the secret is needed (the worker) or to create the key.
    """
    with transaction.atomic():
        # Lock the user row so two first runs at once create one key, not two.
        User.objects.select_for_update().filter(pk=user.pk).first()
        key = ApiKey.objects.filter(user=user, is_playground=True).first()
        if key is not None:
            return key, playground_key_secret(key)
        key, secret = api_key_create(
            user=user, name=PLAYGROUND_KEY_NAME, acting_user=user, is_playground=True
        )
        # api_key_create makes the secret, so it can only be encrypted afterwards; same
        # transaction, so no reader ever sees the key without it.
        key.encrypted_secret = _fernet().encrypt(secret.encode()).decode()
        key.save(update_fields=["encrypted_secret"])
        return key, secret


def worker_secret(user: User) -> str:
    # The key normally exists (run_create makes it); reading it without the lock keeps the
    # worker's path to the first token short.
    key = ApiKey.objects.filter(user=user, is_playground=True).first()
    if key is None:
        return playground_key_get_or_create(user=user)[1]
    return playground_key_secret(key)
