"""Portal forms. Each field's error is shown next to the field by the templates."""

import math

from django import forms
from django.contrib.auth import password_validation
from django.contrib.auth.forms import AuthenticationForm

from . import login_throttle
from .models import LoginThrottleScope, User, UserStatus

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


class LoginForm(AuthenticationForm):
    """Django's login form, refusing an attempt whose account, address or pair of both is
    locked after too many wrong passwords (see `accounts.login_throttle`) before it checks
    the password."""

    LOCKED_MESSAGES = {
        LoginThrottleScope.PAIR: "Too many wrong passwords for this account from your address.",
        LoginThrottleScope.ACCOUNT: "Too many wrong passwords for this account.",
        LoginThrottleScope.ADDRESS: "Too many wrong passwords from your address.",
    }

    def clean(self):
        username = self.cleaned_data.get("username")
        if not username:
            return super().clean()
        ip = self.request.META.get("REMOTE_ADDR", "")
        if lock := login_throttle.login_lock(username=username, ip=ip):
            raise self.locked_error(lock)
        try:
            cleaned = super().clean()
        except forms.ValidationError:
            if lock := login_throttle.login_failed(username=username, ip=ip):
                raise self.locked_error(lock) from None
            raise
        login_throttle.login_succeeded(user=self.get_user(), ip=ip)
        return cleaned

    @classmethod
    def locked_error(cls, lock: login_throttle.Lock) -> forms.ValidationError:
        minutes = math.ceil(lock.seconds / 60)
        return forms.ValidationError(
            f"{cls.LOCKED_MESSAGES[lock.scope]} Try again in "
            f"{minutes} minute{'s' if minutes != 1 else ''}.",
            code="login_locked",
        )


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
