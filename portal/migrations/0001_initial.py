"""The Jobs page's JobSubmission, moved from the playground (its 0016) in state only: the
table playground_jobsubmission, its index, its constraint and its rows are kept as they are."""

import uuid

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("playground", "0016_job_submission_to_portal"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="JobSubmission",
                    fields=[
                        (
                            "id",
                            models.UUIDField(
                                default=uuid.uuid4,
                                editable=False,
                                primary_key=True,
                                serialize=False,
                            ),
                        ),
                        (
                            "kind",
                            models.CharField(
                                choices=[
                                    ("completion", "Completion job"),
                                    ("harvest", "Harvest job"),
                                ],
                                max_length=10,
                            ),
                        ),
                        ("request", models.JSONField()),
                        (
                            "status",
                            models.CharField(
                                choices=[
                                    ("queued", "Queued"),
                                    ("running", "Running"),
                                    ("succeeded", "Succeeded"),
                                    ("failed", "Failed"),
                                    ("cancelled", "Cancelled"),
                                    ("expired", "Expired"),
                                ],
                                db_index=True,
                                default="queued",
                                max_length=10,
                            ),
                        ),
                        ("attempts", models.PositiveSmallIntegerField(default=0)),
                        ("job_id", models.UUIDField(blank=True, null=True)),
                        ("error_code", models.CharField(blank=True, max_length=64)),
                        ("error_message", models.TextField(blank=True)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        ("started_at", models.DateTimeField(blank=True, null=True)),
                        ("finished_at", models.DateTimeField(blank=True, null=True)),
                        ("lease_expires_at", models.DateTimeField(blank=True, null=True)),
                        ("submit_token", models.UUIDField(blank=True, null=True)),
                        (
                            "user",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="job_submissions",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "playground_jobsubmission",
                        "ordering": ["-created_at"],
                        "indexes": [
                            models.Index(
                                fields=["user", "-created_at"],
                                name="playground__user_id_fe468b_idx",
                            )
                        ],
                        "constraints": [
                            models.UniqueConstraint(
                                condition=models.Q(("submit_token__isnull", False)),
                                fields=("user", "submit_token"),
                                name="one_job_submission_per_form_submission",
                            )
                        ],
                    },
                )
            ],
            database_operations=[],
        )
    ]
