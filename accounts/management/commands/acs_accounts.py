"""Operator CLI for accounts:

    acs_accounts create EMAIL [--password P] [--name N] [--approve] [--staff]
    acs_accounts approve|reject|suspend|reactivate EMAIL
    acs_accounts reset-second-factor EMAIL

Bad input (unknown e-mail, wrong status) exits non-zero with a one-line message.
"""

import secrets

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from accounts.models import AccessApplication, ApplicationStatus, User
from accounts.services import applications, second_factor, users

OPERATOR_APPLICATION = "Account created by an operator from the command line."


def user_by_email(email: str) -> User:
    user = User.objects.filter(email__iexact=email.strip()).first()
    if user is None:
        raise CommandError(f"No account with e-mail {email}.")
    return user


def pending_application(user: User) -> AccessApplication:
    application = user.applications.filter(status=ApplicationStatus.PENDING).first()
    if application is None:
        raise CommandError(f"{user.email} has no pending application (status {user.status}).")
    return application


class Command(BaseCommand):
    help = "Create accounts and decide, suspend or reactivate them."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        create = actions.add_parser("create", help="Create an account (pending unless --approve).")
        create.add_argument("email")
        create.add_argument("--password", help="Default: a random password, printed.")
        create.add_argument("--name", default="")
        create.add_argument("--approve", action="store_true", help="Approve it right away.")
        create.add_argument("--staff", action="store_true", help="Give it the staff pages.")
        for action in ("approve", "reject", "suspend", "reactivate"):
            sub = actions.add_parser(action, help=f"{action.capitalize()} an account.")
            sub.add_argument("email")
        reset = actions.add_parser(
            "reset-second-factor",
            help="Remove a staff account's authenticator and recovery codes (both lost): it "
            "enrols a new one at its next staff page.",
        )
        reset.add_argument("email")

    def handle(self, *args, action, email, **options):
        try:
            if action == "create":
                self.create(email, **options)
                return
            user = user_by_email(email)
            if action == "reset-second-factor":
                had = second_factor.second_factor_reset(user=user, acting_user=None)
                self.stdout.write(
                    f"{user.email}'s second factor is reset: they enrol a new authenticator "
                    "at their next staff page."
                    if had
                    else f"{user.email} had no second factor."
                )
                return
            if action == "approve":
                applications.application_approve(
                    application=pending_application(user), acting_user=None
                )
            elif action == "reject":
                applications.application_reject(
                    application=pending_application(user), acting_user=None
                )
            elif action == "suspend":
                users.user_suspend(user=user, acting_user=None)
            else:
                users.user_reactivate(user=user, acting_user=None)
        except ValidationError as error:
            raise CommandError(" ".join(error.messages)) from error
        user.refresh_from_db()
        self.stdout.write(f"{user.email} is now {user.status}.")

    def create(self, email, *, password, name, approve, staff, **_):
        if User.objects.filter(email__iexact=email.strip()).exists():
            raise CommandError(f"An account with e-mail {email} already exists.")
        generated = password is None
        password = secrets.token_urlsafe(12) if generated else password
        with transaction.atomic():
            user = applications.user_signup(
                email=email.strip(),
                password=password,
                name=name,
                organisation="",
                planned_use=OPERATOR_APPLICATION,
                accepted_usage_rules=True,
            )
            if staff:
                user.is_staff = True
                user.save(update_fields=["is_staff"])
            if approve:
                applications.application_approve(
                    application=pending_application(user), acting_user=None
                )
        user.refresh_from_db()
        self.stdout.write(f"Created {user.email} ({user.status}{', staff' if staff else ''}).")
        if generated:
            self.stdout.write(f"Password: {password}")
        if approve:
            self.stdout.write("Its first key waits on the API keys page (/keys/).")
