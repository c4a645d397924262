"""A run's steering is its request's steering entry alone: `scale` becomes that entry's scale
(a steered run re-run from its page had none), and `meta["layers"]`, a copy of the entry's
layers, goes. Back, `meta["layers"]` returns where the old pages read it (steering
comparisons and sweeps, steered completions); `scale` keeps the request's, which the old
code reads alike."""

from django.db import migrations

from acs_client.protocol import XARGS_STEERING

# The kinds whose runs kept the steered layers in `meta` (with completions that steered).
LAYERS_IN_META = ("steering_baseline", "steering_steered", "sweep", "completion")
BATCH = 500


def steering_entry(run) -> dict | None:
    return (run.request.get(XARGS_STEERING) or [None])[0]


def scale_and_layers_from_request(apps, schema_editor):
    Run = apps.get_model("playground", "Run")
    changed = []
    for run in Run.objects.only("id", "scale", "meta", "request").iterator(chunk_size=BATCH):
        entry = steering_entry(run)
        scale = entry.get("scale", 1.0) if entry else None
        meta = {key: value for key, value in run.meta.items() if key != "layers"}
        if scale != run.scale or meta != run.meta:
            run.scale, run.meta = scale, meta
            changed.append(run)
    Run.objects.bulk_update(changed, ["scale", "meta"], batch_size=BATCH)


def layers_back_in_meta(apps, schema_editor):
    Run = apps.get_model("playground", "Run")
    changed = []
    runs = Run.objects.filter(kind__in=LAYERS_IN_META, request__has_key=XARGS_STEERING)
    for run in runs.only("id", "meta", "request").iterator(chunk_size=BATCH):
        entry = steering_entry(run)
        if entry:
            run.meta = {**run.meta, "layers": entry["layer_indices"]}
            changed.append(run)
    Run.objects.bulk_update(changed, ["meta"], batch_size=BATCH)


class Migration(migrations.Migration):
    dependencies = [("playground", "0017_probes_steering_evaluations_patchscopes")]

    operations = [migrations.RunPython(scale_and_layers_from_request, layers_back_in_meta)]
