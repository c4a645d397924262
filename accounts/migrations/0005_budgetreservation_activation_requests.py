from django.db import migrations, models


def count_from_flag(apps, schema_editor):
    # The flag stood for one activation request (a /v1 request); harvest batches held more,
    # but only holds still reserved are ever given back, and those are short-lived.
    BudgetReservation = apps.get_model("accounts", "BudgetReservation")
    BudgetReservation.objects.filter(activation=True).update(activation_requests=1)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0004_budget_holds_alive_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="budgetreservation",
            name="activation_requests",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunPython(count_from_flag, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name="budgetreservation",
            name="activation",
        ),
    ]
