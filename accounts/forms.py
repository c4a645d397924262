"""Portal forms. Each field's error is shown next to the field by the templates."""

import math

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm, AdminPasswordChangeForm
from django.contrib.auth import authenticate, password_validation
from django.contrib.auth.forms import AuthenticationForm

from . import login_throttle
from .access import second_factor_required
from .models import LoginThrottleScope, User, UserStatus
from .services import second_factor

USAGE_RULES = (
    "I will use ACS for research only, will not try to extract the model weights or attack "
    "the service, will keep my API keys secret, and accept that requests are logged "
    "(metadata only) and that access may be revoked."
)


class ApplicationForm(forms.Form):
    """The access application (re-application of a rejected account uses this alone)."""

    planned_use = forms.CharField(
        widget=forms.Textarea,
        max_length=5000,
        help_text="What you want to study with ACS and how.",
    )
    prior_work = forms.CharField(
        widget=forms.Textarea,
        max_length=5000,
        required=False,
        help_text="Papers, posts or code of yours relevant to interpretability.",
    )
    profile_link = forms.URLField(
        required=False, help_text="A page about you (homepage, Google Scholar, GitHub)."
    )
    accepted_usage_rules = forms.BooleanField(
        label="I accept the usage rules",
        help_text=USAGE_RULES,
        error_messages={"required": "Accept the usage rules to apply."},
    )


class SignupForm(ApplicationForm):
    email = forms.EmailField(label="E-mail")
    password = forms.CharField(widget=forms.PasswordInput, strip=False)
    name = forms.CharField(max_length=200)
    organisation = forms.CharField(max_length=200, required=False)

    field_order = ["email", "password", "name", "organisation"]

    def clean_email(self):
        email = self.cleaned_data["email"].lower()
        if User.objects.filter(email__iexact=email).exists():
            raise forms.ValidationError(
                "An account with this e-mail already exists; log in instead."
            )
        return email

    def clean(self):
        cleaned = super().clean()
        password = cleaned.get("password")
        if password:
            candidate = User(email=cleaned.get("email", ""), name=cleaned.get("name", ""))
            try:
                password_validation.validate_password(password, candidate)
            except forms.ValidationError as error:
                self.add_error("password", error)
        return cleaned


def client_address(request) -> str:
    return request.META.get("REMOTE_ADDR", "")


class ThrottledSecretMixin:
    """A form that checks a secret of an account (a password, a second factor's code) through
    `accounts.login_throttle`: refused before the secret is checked while the account, the
    address or the pair of both is locked after too many wrong ones, and a wrong one is
    counted. Needs `self.request` (for the client's address)."""

    # What the form's lock message calls the secrets that were wrong.
    SECRETS = "passwords"
    LOCKED_SUBJECTS = {
        LoginThrottleScope.PAIR: "for this account from your address",
        LoginThrottleScope.ACCOUNT: "for this account",
        LoginThrottleScope.ADDRESS: "from your address",
    }

    def secret_checked(self, username: str, check) -> bool:
        """Whether `check()` found the secret typed for the account `username` right; raises
        the lock's error while it is locked, or when this wrong secret locked it."""
        attempt = login_throttle.login_attempt(
            username=username, ip=client_address(self.request), check=check
        )
        if attempt.lock is not None:
            raise self.locked_error(attempt.lock)
        return attempt.right

    def locked_error(self, lock: login_throttle.Lock) -> forms.ValidationError:
        minutes = math.ceil(lock.seconds / 60)
        return forms.ValidationError(
            f"Too many wrong {self.SECRETS} {self.LOCKED_SUBJECTS[lock.scope]}. Try again in "
            f"{minutes} minute{'s' if minutes != 1 else ''}.",
            code="login_locked",
        )


class ThrottledLoginMixin(ThrottledSecretMixin):
    """Django's login form (the portal's or the admin's), its password checked through the
    throttle. The sign-in is done for the throttle (`login_succeeded`: this address's count for
    the account forgotten, the address known) here, or for staff only after their second
    factor (`SecondFactorForm`): else whoever has a staff password would wipe their count of
    wrong codes by signing in again."""

    def clean(self):
        username = self.cleaned_data.get("username")
        password = self.cleaned_data.get("password")
        if not (username and password):
            return self.cleaned_data  # the field's own error says what is missing
        if not self.secret_checked(username, lambda: self._authenticated(username, password)):
            raise self.get_invalid_login_error()
        self.confirm_login_allowed(self.user_cache)
        if not second_factor_required(self.user_cache):
            login_throttle.login_succeeded(user=self.user_cache, ip=client_address(self.request))
        return self.cleaned_data

    def _authenticated(self, username: str, password: str) -> bool:
        self.user_cache = authenticate(self.request, username=username, password=password)
        return self.user_cache is not None


class LoginForm(ThrottledLoginMixin, AuthenticationForm):
    """The portal's login form (/login/)."""


class AdminLoginForm(ThrottledLoginMixin, AdminAuthenticationForm):
    """The admin's login form (/admin/login/): staff accounts only."""


class OwnPasswordChangeForm(ThrottledSecretMixin, AdminPasswordChangeForm):
    """The admin's change of one's own password, its old password checked through the
    throttle."""

    def __init__(self, user, *args, request, **kwargs):
        super().__init__(user, *args, **kwargs)
        self.request = request

    def clean_old_password(self):
        old_password = self.cleaned_data["old_password"]
        if not self.secret_checked(self.user.email, lambda: self.user.check_password(old_password)):
            raise forms.ValidationError(
                self.error_messages["password_incorrect"], code="password_incorrect"
            )
        return old_password


class SecondFactorForm(ThrottledSecretMixin, forms.Form):
    """A staff member's second factor after their password: a code of their authenticator
    app or one of their recovery codes (or, `enrolling`, a code of the authenticator they are
    enrolling), checked through the throttle as a password is, in the same counts. `device`
    is the device that took it. A right one completes the sign-in for the throttle."""

    SECRETS = "passwords or codes"

    code = forms.CharField(
        max_length=40,
        strip=True,
        widget=forms.TextInput(attrs={"autocomplete": "one-time-code", "autofocus": True}),
    )

    def __init__(self, *args, request, enrolling=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.request, self.enrolling, self.device = request, enrolling, None
        self.fields["code"].help_text = (
            "The 6 digits your authenticator app shows now."
            if enrolling
            else "The 6 digits your authenticator app shows, or one of your recovery codes."
        )

    def clean_code(self):
        code = self.cleaned_data["code"]
        user = self.request.user
        if not self.secret_checked(user.email, lambda: self._matched(user, code)):
            raise forms.ValidationError(
                "That code is wrong, or was used already.", code="wrong_code"
            )
        login_throttle.login_succeeded(user=user, ip=client_address(self.request))
        return code

    def _matched(self, user, code: str) -> bool:
        self.device = second_factor.second_factor_match(
            user=user, code=code, confirmed=not self.enrolling
        )
        return self.device is not None


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="So you can tell your keys apart.")


class KeyRenameForm(forms.Form):
    name = forms.CharField(max_length=100)


class DecisionForm(forms.Form):
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("reject", "Reject")])
    note = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False)
    # A rejection happens only once confirmed: by the browser's hx-confirm dialog, or else
    # on the confirmation page the first post leads to.
    confirmed = forms.BooleanField(required=False, widget=forms.HiddenInput)


class UserSearchForm(forms.Form):
    q = forms.CharField(label="Search", required=False)
    status = forms.ChoiceField(choices=[("", "Any status"), *UserStatus.choices], required=False)


class AuditFilterForm(forms.Form):
    actor = forms.CharField(required=False, help_text="E-mail contains")
    action = forms.CharField(required=False, help_text="e.g. key. or user.approve")
    target = forms.CharField(required=False, help_text="Type, id or description")


class SpendCapForm(forms.Form):
    paused = forms.BooleanField(label="Pause all API traffic (429 spend_cap)", required=False)
    reason = forms.CharField(max_length=200, required=False)
