from django.db import migrations

# A patching grid's runs cancelled before they were sent were failed with the code
# "cancelled"; they now have the status CANCELLED (and no error). Scorings and comparisons,
# which counted no attempts, count the one claim each that is not queued any more had.
CANCELLED_CODE = "cancelled"
CANCELLED_MESSAGE = "Cancelled with its patching grid before it was sent."


def forward(apps, schema_editor):
    Run = apps.get_model("playground", "Run")
    Run.objects.filter(status="failed", error_code=CANCELLED_CODE).update(
        status="cancelled", error_code="", error_message=""
    )
    for name in ("SteeringScore", "RunComparison"):
        apps.get_model("playground", name).objects.exclude(status="queued").update(attempts=1)


def backward(apps, schema_editor):
    Run = apps.get_model("playground", "Run")
    Run.objects.filter(status="cancelled").update(
        status="failed", error_code=CANCELLED_CODE, error_message=CANCELLED_MESSAGE
    )


class Migration(migrations.Migration):
    dependencies = [
        ("playground", "0014_work_row_columns"),
    ]

    operations = [migrations.RunPython(forward, backward)]
