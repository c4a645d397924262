from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class AccountsConfig(AppConfig):
    name = "accounts"


class AdminConfig(admin_apps.AdminConfig):
    """Django's admin, its default site `accounts.admin_site.AdminSite` (in INSTALLED_APPS in
    place of django.contrib.admin; not the accounts app's own config)."""

    default = False
    default_site = "accounts.admin_site.AdminSite"
