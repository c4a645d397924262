from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("playground", "0010_run_sent_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="lens",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
