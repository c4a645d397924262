from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class ApiConfig(AppConfig):
    name = "api"

    def ready(self):
        from accounts.models import ApiKey, ServiceSettings, User

        from .auth import bump_after_commit

        # The spend cap too: budget leases are bound to the key snapshot (see metering.leases).
        for model in (ApiKey, User, ServiceSettings):
            post_save.connect(bump_after_commit, sender=model, dispatch_uid=f"access-{model}")
            post_delete.connect(bump_after_commit, sender=model, dispatch_uid=f"access-del-{model}")
