"""Operator CLI for API keys:

    acs_keys create EMAIL [--name N] [--monthly-budget T] [--daily-budget T]
    acs_keys list [EMAIL]
    acs_keys revoke|disable|enable PREFIX

`create` prints the secret alone on the last line of stdout (for scripts). Bad input exits
non-zero with a one-line message.
"""

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from accounts.models import ApiKey, UserStatus
from accounts.services import keys

from .acs_accounts import user_by_email


def non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(value)
    return number


def key_by_prefix(prefix: str) -> ApiKey:
    """Accepts `abcd1234`, `acs-abcd1234` or a whole secret."""
    bare = prefix.strip().removeprefix("acs-")[:8]
    key = ApiKey.objects.select_related("user").filter(prefix=bare).first()
    if key is None:
        raise CommandError(f"No API key with prefix {prefix}.")
    return key


class Command(BaseCommand):
    help = "Create, list, revoke, pause (disable) and resume (enable) API keys."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        create = actions.add_parser("create", help="Create a key; prints the secret last.")
        create.add_argument("email")
        create.add_argument("--name", default="CLI key")
        create.add_argument("--monthly-budget", type=non_negative, metavar="TOKENS")
        create.add_argument("--daily-budget", type=non_negative, metavar="TOKENS")
        listing = actions.add_parser("list", help="List keys (of one account).")
        listing.add_argument("email", nargs="?")
        for action in ("revoke", "disable", "enable"):
            actions.add_parser(action, help=f"{action.capitalize()} a key.").add_argument("prefix")

    def handle(self, *args, action, **options):
        try:
            if action == "create":
                self.create(**options)
            elif action == "list":
                self.list(options["email"])
            else:
                change = {
                    "revoke": keys.api_key_revoke,
                    "disable": keys.api_key_disable,
                    "enable": keys.api_key_enable,
                }[action]
                key = change(key=key_by_prefix(options["prefix"]), acting_user=None)
                self.stdout.write(f"acs-{key.prefix} ({key.name}) is now {key.status}.")
        except ValidationError as error:
            raise CommandError(" ".join(error.messages)) from error

    def create(self, *, email, name, monthly_budget, daily_budget, **_):
        user = user_by_email(email)
        if user.status != UserStatus.APPROVED:
            raise CommandError(f"{user.email} is {user.status}; only approved accounts get keys.")
        key, secret = keys.api_key_create(
            user=user,
            name=name,
            acting_user=None,
            monthly_token_budget=monthly_budget,
            daily_token_budget=daily_budget,
        )
        self.stdout.write(
            f"Created key acs-{key.prefix} ({key.name}) for {user.email}: "
            f"{key.monthly_token_budget} tokens/month, {key.daily_token_budget} tokens/day. "
            "The secret follows; it is not stored and cannot be shown again."
        )
        self.stdout.write(secret)

    def list(self, email):
        keys = ApiKey.objects.select_related("user").order_by("user__email", "-created_at")
        if email:
            keys = keys.filter(user=user_by_email(email))
        self.stdout.write(
            f"{'PREFIX':<12} {'STATUS':<9} {'MONTHLY':>12} {'DAILY':>10} "
            f"{'CREATED':<16} {'LAST USED':<16} {'OWNER':<30} NAME"
        )
        for key in keys:
            last_used = f"{key.last_used_at:%Y-%m-%d %H:%M}" if key.last_used_at else "never"
            name = f"{key.name} (managed)" if key.is_playground else key.name
            self.stdout.write(
                f"acs-{key.prefix:<8} {key.status:<9} {key.monthly_token_budget:>12} "
                f"{key.daily_token_budget:>10} {key.created_at:%Y-%m-%d %H:%M} "
                f"{last_used:<16} {key.user.email:<30} {name}"
            )
