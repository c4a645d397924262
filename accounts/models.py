"""Accounts, access applications, API keys (with their budget limits), the audit log and
service-wide settings. The budget windows' rows, reservations, leases and usage records are
`metering`'s models."""

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, BaseUserManager, PermissionsMixin
from django.db import models
from django.db.models import Q
from django.utils import timezone


class UserStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"
    SUSPENDED = "suspended", "Suspended"


class UserManager(BaseUserManager):
    use_in_migrations = True

    def create_user(self, email, password=None, **extra_fields):
        if not email:
            raise ValueError("An e-mail address is required.")
        user = self.model(email=self.normalize_email(email).lower(), **extra_fields)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def create_superuser(self, email, password=None, **extra_fields):
        extra_fields.setdefault("is_staff", True)
        extra_fields.setdefault("is_superuser", True)
        extra_fields.setdefault("status", UserStatus.APPROVED)
        return self.create_user(email, password, **extra_fields)


def default_account_activation_quota() -> int:
    return settings.ACS_DEFAULT_ACCOUNT_ACTIVATION_QUOTA


def default_account_harvest_quota() -> int:
    return settings.ACS_DEFAULT_ACCOUNT_HARVEST_QUOTA


class User(AbstractBaseUser, PermissionsMixin):
    email = models.EmailField(unique=True)
    name = models.CharField(max_length=200, blank=True)
    organisation = models.CharField(max_length=200, blank=True)
    status = models.CharField(
        max_length=16, choices=UserStatus.choices, default=UserStatus.PENDING, db_index=True
    )
    is_staff = models.BooleanField(default=False)
    is_active = models.BooleanField(default=True)
    date_joined = models.DateTimeField(default=timezone.now)
    status_changed_at = models.DateTimeField(null=True, blank=True)
    # Account-wide monthly budget across all the user's keys; set at approval.
    monthly_token_budget = models.PositiveBigIntegerField(default=0)
    # Account-wide quotas across all the user's keys (each key has its own as well).
    monthly_activation_quota = models.PositiveIntegerField(default=default_account_activation_quota)
    monthly_harvest_quota = models.PositiveIntegerField(default=default_account_harvest_quota)
    # Keys the account may hold at once; empty: settings.ACS_MAX_KEYS_PER_ACCOUNT.
    key_limit = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: the site's default (ACS_MAX_KEYS_PER_ACCOUNT)."
    )

    objects = UserManager()

    USERNAME_FIELD = "email"
    EMAIL_FIELD = "email"
    REQUIRED_FIELDS = []

    def __str__(self):
        return self.email

    @property
    def is_approved(self):
        return self.status == UserStatus.APPROVED

    @property
    def keys_allowed(self) -> int:
        return self.key_limit or settings.ACS_MAX_KEYS_PER_ACCOUNT


class ApplicationStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"


class AccessApplication(models.Model):
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="applications")
    planned_use = models.TextField()
    prior_work = models.TextField(blank=True)
    profile_link = models.URLField(blank=True)
    accepted_usage_rules = models.BooleanField(default=False)
    status = models.CharField(
        max_length=16,
        choices=ApplicationStatus.choices,
        default=ApplicationStatus.PENDING,
        db_index=True,
    )
    created_at = models.DateTimeField(default=timezone.now)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decision_note = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"Application of {self.user} ({self.status})"


class KeyStatus(models.TextChoices):
    ACTIVE = "active", "Active"
    DISABLED = "disabled", "Paused"
    REVOKED = "revoked", "Revoked"


class Scope(models.TextChoices):
    COMPLETIONS = "completions", "Completions"


class ApiKey(models.Model):
    """An API key. Only `prefix` and an HMAC of the whole key are stored; the secret is shown
    once. Playground keys are managed by the portal and keep an encrypted secret so workers
    can use them."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=8, unique=True)
    secret_hash = models.CharField(max_length=64)
    scopes = models.JSONField(default=list)
    status = models.CharField(max_length=16, choices=KeyStatus.choices, default=KeyStatus.ACTIVE)
    is_playground = models.BooleanField(default=False)
    encrypted_secret = models.TextField(blank=True)
    # The secret of a key created for the user (at approval, or by a form that redirects),
    # encrypted, until the API keys page shows it once and clears it. See
    # `services.keys.api_key_reveal_store` / `api_key_reveals_take`.
    pending_reveal = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField()
    daily_token_budget = models.PositiveBigIntegerField()
    monthly_input_budget = models.PositiveBigIntegerField(null=True, blank=True)
    monthly_output_budget = models.PositiveBigIntegerField(null=True, blank=True)
    monthly_activation_quota = models.PositiveIntegerField()
    monthly_harvest_quota = models.PositiveIntegerField()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # At most one managed playground key per user.
            models.UniqueConstraint(
                fields=["user"], condition=Q(is_playground=True), name="one_playground_key"
            )
        ]

    def __str__(self):
        return f"acs-{self.prefix} ({self.name})"

    def limits(self) -> dict:
        """The key's budgets and quotas by field name (for audit): its fields named
        `*_budget` or `*_quota`, each the limit of a budget window (`metering.windows`)."""
        return {
            field.name: getattr(self, field.name)
            for field in self._meta.concrete_fields
            if field.name.endswith(("_budget", "_quota"))
        }


class ServiceSettings(models.Model):
    """Service-wide switches (one row, pk=1)."""

    spend_cap_paused = models.BooleanField(default=False)
    spend_cap_reason = models.CharField(max_length=200, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        verbose_name_plural = "service settings"

    @classmethod
    def current(cls):
        return cls.objects.get_or_create(pk=1)[0]


class LoginThrottleScope(models.TextChoices):
    PAIR = "pair", "Account from one address"
    ACCOUNT = "account", "Account from any address"
    ADDRESS = "address", "Address, any account"


class LoginThrottle(models.Model):
    """Wrong passwords counted for one subject of login throttling (`accounts.login_throttle`):
    an account and address pair, an account, or an address. `subject` is a digest of it, so
    what people type in the e-mail field (sometimes a password) is not stored."""

    scope = models.CharField(max_length=8, choices=LoginThrottleScope.choices)
    subject = models.CharField(max_length=64)
    # Wrong passwords since `window_started_at`; the window lasts ACS_LOGIN_LOCKOUT_SECONDS.
    failures = models.PositiveIntegerField(default=0)
    window_started_at = models.DateTimeField(default=timezone.now)
    locked_until = models.DateTimeField(null=True, blank=True)
    # Locks so far: an account's lockout doubles with each (forgotten a day after the last
    # lock, or when staff lift it).
    locks = models.PositiveSmallIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "subject"], name="login_throttle_subject")
        ]
        indexes = [models.Index(fields=["window_started_at"])]

    def __str__(self):
        return f"{self.get_scope_display()} ({self.subject[:12]})"


class LoginAddress(models.Model):
    """An IP address from which `user` signed in with the right password, last at
    `last_login_at`: their account's lock (guesses spread over many addresses) does not apply
    to it for ACS_LOGIN_KNOWN_ADDRESS_SECONDS after that (`accounts.login_throttle`)."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="login_addresses")
    # REMOTE_ADDR as the throttle takes it, an opaque string as in its digests.
    ip = models.TextField()
    last_login_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "ip"], name="login_address_user_ip")]
        indexes = [models.Index(fields=["last_login_at"])]

    def __str__(self):
        return f"{self.user} from {self.ip}"


class AuditLog(models.Model):
    """Who changed access or money, what, and how (before/after)."""

    actor = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_actions"
    )
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64)
    target_repr = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    note = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.target_repr}"

    def changes(self) -> list[tuple[str, str, str]]:
        """What the action changed, as text a person reads: `(field, before, after)` per
        field whose value differs, nested settings under dotted names
        ("budgets.daily_token_budget"), "—" where a side has no such field (a creation has
        no before). Unchanged fields are left out."""
        before, after = _audit_fields(self.before), _audit_fields(self.after)
        return [
            (field, _audit_value(before, field), _audit_value(after, field))
            for field in [*before, *(name for name in after if name not in before)]
            if before.get(field, _MISSING) != after.get(field, _MISSING)
        ]


_MISSING = object()


def _audit_fields(value, prefix="") -> dict:
    """An audit side as one flat {dotted field: value} dict (a non-dict side is `value`)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        return {prefix or "value": value}
    flat = {}
    for name, item in value.items():
        field = f"{prefix}.{name}" if prefix else str(name)
        flat.update(_audit_fields(item, field) if isinstance(item, dict) else {field: item})
    return flat


def _audit_value(fields: dict, field: str) -> str:
    value = fields.get(field, _MISSING)
    if value is _MISSING:
        return "—"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(str(item) for item in value) or "none"
    return str(value)
