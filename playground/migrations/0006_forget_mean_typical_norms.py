"""Typical layer norms measured before the reference prompts were the mean ‖h‖ of the two
contrast captures, the first token included: inflated many times by the first token's norm
(3552 against ~130 at layer 12 of SmolLM2-135M). They are forgotten rather than shown; those
vectors take absolute scales until rebuilt."""

from django.db import migrations


def forget_mean_typical_norms(apps, schema_editor):
    SteeringVector = apps.get_model("playground", "SteeringVector")
    for vector in SteeringVector.objects.exclude(layer_typical_norm=None):
        if "typical_norm" not in (vector.details or {}):
            vector.layer_typical_norm = None
            vector.save(update_fields=["layer_typical_norm"])


class Migration(migrations.Migration):
    dependencies = [
        ("playground", "0005_steering_score"),
    ]

    operations = [
        migrations.RunPython(forget_mean_typical_norms, migrations.RunPython.noop),
    ]
