"""Staff's second factor for the tests and the benches: the code an authenticator app shows
(RFC 6238, computed apart from django-otp), and a Django test client signed in as staff with
their second factor passed, as the login and second-factor pages would leave it.

`totp_code` is plain Python; the other helpers import Django where they run (the web
virtualenv's tests and benches), so this module loads in every virtualenv."""

import hmac
import struct
import time

# The secret (hex, as django-otp stores it) of the test and bench staff's authenticator app.
TOTP_KEY = "8a1c3b5e7f90d2e4f6a8b0c2d4e6f8091a2b3c4d"


def totp_code(key: bytes | str, *, at: float | None = None) -> str:
    """The code an authenticator app shows for the secret `key` (bytes, or hex) at `at` (now):
    RFC 6238 (HMAC-SHA1, 30 s steps, 6 digits)."""
    secret = bytes.fromhex(key) if isinstance(key, str) else key
    counter = int((time.time() if at is None else at) // 30)
    digest = hmac.new(secret, struct.pack(">Q", counter), "sha1").digest()
    offset = digest[-1] & 0x0F
    number = struct.unpack(">I", digest[offset : offset + 4])[0] & 0x7FFFFFFF
    return f"{number % 10**6:06d}"


def authenticator_enrolled(user, key: str = TOTP_KEY):
    """`user`'s authenticator (a django-otp TOTPDevice), as after enrolment: the one they have,
    else one of secret `key`."""
    from django_otp.plugins.otp_totp.models import TOTPDevice

    device = TOTPDevice.objects.filter(user=user, confirmed=True).first()
    if device is None:
        device = TOTPDevice.objects.create(
            user=user, name="Authenticator app", key=key, confirmed=True
        )
    return device


def sign_in(client, user):
    """Sign `user` in on the Django test `client` as the login page would, and for staff the
    second-factor page too (both skipped, as `force_login` skips the password: their own tests
    try them): the session is verified by the user's authenticator, enrolled now if they have
    none. Returns the client."""
    from django_otp import DEVICE_ID_SESSION_KEY

    from accounts.access import second_factor_required

    client.force_login(user)
    if second_factor_required(user):
        session = client.session
        session[DEVICE_ID_SESSION_KEY] = authenticator_enrolled(user).persistent_id
        session.save()
    return client
