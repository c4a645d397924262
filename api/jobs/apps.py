from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "api.jobs"
    label = "jobs"
