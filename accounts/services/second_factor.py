"""Staff's second factor: an authenticator app (a django-otp TOTP device) and one-time
recovery codes (its static device), enrolled by the staff member at their first admin or staff
page, asked for after each password sign-in before those pages (`accounts.access`), and
removed by staff when both are lost. Codes are checked through the login throttle
(`accounts.forms.SecondFactorForm`)."""

from base64 import b32encode

from django.db import transaction
from django_otp import devices_for_user
from django_otp.plugins.otp_static.models import StaticDevice, StaticToken
from django_otp.plugins.otp_totp.models import TOTPDevice

from .audit import audit_log

# Recovery codes given at enrolment, each good for one sign-in.
RECOVERY_CODES = 10


def second_factor_enrolment(*, user) -> TOTPDevice:
    """The authenticator `user` is enrolling (unconfirmed until they type one of its codes):
    the same one at each visit of the enrolment page, so its secret stays what their app
    holds; made at the first."""
    device = TOTPDevice.objects.filter(user=user, confirmed=False).order_by("pk").first()
    if device is None:
        device = TOTPDevice.objects.create(user=user, name="Authenticator app", confirmed=False)
    return device


def totp_secret(device: TOTPDevice) -> str:
    """The device's secret as an authenticator app takes it typed: base32, in groups of 4."""
    secret = b32encode(device.bin_key).decode()
    return " ".join(secret[i : i + 4] for i in range(0, len(secret), 4))


def code_normalized(code: str) -> str:
    """A code as typed (spaces, hyphens, capitals) as its device stores it."""
    return "".join(code.split()).replace("-", "").lower()


def second_factor_match(*, user, code: str, confirmed: bool = True):
    """The device of `user` that accepts `code`: a code of their authenticator (each taken
    once: not again within its 30 s) or a recovery code (used up); None when none does. The
    devices are locked while checked, so two requests with one code cannot both pass.
    `confirmed=False`: the authenticator being enrolled instead."""
    code = code_normalized(code)
    with transaction.atomic():
        for device in devices_for_user(user, confirmed=confirmed, for_verify=True):
            if device.verify_token(code):
                return device
    return None


def second_factor_enrol(*, device: TOTPDevice) -> list[str]:
    """Confirm the authenticator `device` (its owner typed one of its codes), and give its
    owner RECOVERY_CODES new recovery codes; returns them, for the page that shows them once.
    Audited `user.second_factor_enrolled`."""
    user = device.user
    with transaction.atomic():
        device.confirmed = True
        device.save(update_fields=["confirmed"])
        TOTPDevice.objects.filter(user=user, confirmed=False).delete()
        StaticDevice.objects.filter(user=user).delete()
        recovery = StaticDevice.objects.create(user=user, name="Recovery codes", confirmed=True)
        codes = [StaticToken.random_token() for _ in range(RECOVERY_CODES)]
        StaticToken.objects.bulk_create(StaticToken(device=recovery, token=c) for c in codes)
        audit_log(
            actor=user,
            action="user.second_factor_enrolled",
            target=user,
            after={"recovery_codes": len(codes)},
        )
    return codes


def recovery_codes_left(*, user) -> int:
    return StaticToken.objects.filter(device__user=user, device__confirmed=True).count()


def second_factor_reset(*, user, acting_user) -> bool:
    """Staff remove `user`'s authenticator and recovery codes (both lost): they enrol a new
    authenticator at their next admin or staff page. Returns whether there was one; audited
    `user.second_factor_reset`."""
    with transaction.atomic():
        removed = sum(
            model.objects.filter(user=user).delete()[1].get(model._meta.label, 0)
            for model in (TOTPDevice, StaticDevice)
        )
        audit_log(actor=acting_user, action="user.second_factor_reset", target=user, after={})
    return bool(removed)
