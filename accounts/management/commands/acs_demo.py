"""Demo data for `make run`: a staff account and an approved researcher with a key.

The staff account enrols its second factor at its first sign-in, as any staff account does (no
known secret is planted, so the demo data is safe on a reachable machine); the output says so.

Idempotent: later runs create nothing and never print a key again (its secret is not
stored); they say how to make another.
"""

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction

from accounts.models import ApplicationStatus, User
from accounts.services import applications, keys

STAFF_EMAIL = "staff@acs.local"
STAFF_PASSWORD = "acs-demo-staff"
RESEARCHER_EMAIL = "researcher@acs.local"
RESEARCHER_PASSWORD = "acs-demo-researcher"


class Command(BaseCommand):
    help = "Create the demo staff and researcher accounts (idempotent) and print the logins."

    def handle(self, *args, **options):
        with transaction.atomic():
            self.ensure_staff()
            secret = self.ensure_researcher()
        site = settings.SITE_URL.rstrip("/")
        self.stdout.write(f"ACS Portal: {site}/")
        self.stdout.write(f"  staff login:      {STAFF_EMAIL} / {STAFF_PASSWORD}")
        self.stdout.write(
            "    then a second factor: at the first sign-in, add the secret the page shows to an "
            "authenticator app\n    (or use `oathtool --totp -b SECRET`); lost it: "
            f"python manage.py acs_accounts reset-second-factor {STAFF_EMAIL}"
        )
        self.stdout.write(f"  researcher login: {RESEARCHER_EMAIL} / {RESEARCHER_PASSWORD}")
        if secret:
            self.stdout.write(f"  researcher's demo API key (shown only this once): {secret}")
        else:
            self.stdout.write(
                "  The researcher's demo API key was printed on the first run; create another "
                f"with: python manage.py acs_keys create {RESEARCHER_EMAIL}"
            )

    def ensure_staff(self):
        if User.objects.filter(email=STAFF_EMAIL).exists():
            return
        User.objects.create_superuser(STAFF_EMAIL, STAFF_PASSWORD, name="Demo staff")

    def ensure_researcher(self) -> str | None:
        """Create the researcher and return the demo key's secret, or None if they exist."""
        if User.objects.filter(email=RESEARCHER_EMAIL).exists():
            return None
        user = applications.user_signup(
            email=RESEARCHER_EMAIL,
            password=RESEARCHER_PASSWORD,
            name="Demo researcher",
            organisation="ACS demo",
            planned_use="Trying out ACS locally.",
            accepted_usage_rules=True,
        )
        application = user.applications.get(status=ApplicationStatus.PENDING)
        applications.application_approve(application=application, acting_user=None)
        # Approval left the first key's secret waiting for /keys/; print it here instead.
        [(_key, secret)] = keys.api_key_reveals_take(user=user)
        return secret
