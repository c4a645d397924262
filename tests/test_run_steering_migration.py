"""The migration that leaves a run's steering in its request alone runs forward and back on the
real PostgreSQL test database with rows in it: forward, `scale` becomes the request's
steering scale (a steered run re-run from its page had none) and `meta["layers"]`, a copy of
the steered layers, goes; back, `meta["layers"]` returns where the old pages read it."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from acs_client.protocol import XARGS_STEERING

BEFORE = [("playground", "0017_probes_steering_evaluations_patchscopes")]
AFTER = [("playground", "0018_run_steering_from_request")]


def migrate(targets):
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state(targets).apps


def steered(scale: float | None, layers: list[int]) -> dict:
    entry = {"activations": {"data": "AAAA"}, "layer_indices": layers}
    if scale is not None:
        entry["scale"] = scale
    return {"model": "m", "prompt": "a", XARGS_STEERING: [entry]}


def rows(apps) -> dict:
    Run = apps.get_model("playground", "Run")
    return {run["kind"]: (run["scale"], run["meta"]) for run in Run.objects.values()}


@pytest.mark.django_db(transaction=True)
def test_the_steering_migration_takes_scale_from_the_request_forward_and_back(approved_user):
    try:
        Run = migrate(BEFORE).get_model("playground", "Run")
        rows_before = {
            # A re-run of a steered completion: its scale only in the request.
            "completion": (None, {"vector_name": "joy"}, steered(4.0, [6])),
            "sweep": (8.0, {"layers": [3, 5], "target_token": " x"}, steered(8.0, [3, 5])),
            # A patched cell: the request's entry leaves the scale to its default of 1.
            "patched": (1.0, {"role": "cell", "layer": 2}, steered(None, [2])),
            "contrast": (None, {"role": "positive", "layer": 1}, {"model": "m", "prompt": "a"}),
        }
        for kind, (scale, meta, request) in rows_before.items():
            Run.objects.create(
                user_id=approved_user.pk, kind=kind, scale=scale, meta=meta, request=request
            )

        assert rows(migrate(AFTER)) == {
            "completion": (4.0, {"vector_name": "joy"}),
            "sweep": (8.0, {"target_token": " x"}),
            "patched": (1.0, {"role": "cell", "layer": 2}),
            "contrast": (None, {"role": "positive", "layer": 1}),
        }
        assert rows(migrate(BEFORE)) == {
            "completion": (4.0, {"vector_name": "joy", "layers": [6]}),
            "sweep": (8.0, {"target_token": " x", "layers": [3, 5]}),
            "patched": (1.0, {"role": "cell", "layer": 2}),
            "contrast": (None, {"role": "positive", "layer": 1}),
        }
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
