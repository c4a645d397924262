"""The group page's context: a steering comparison's or sweep's runs, their same-token
scores, figures, scrubber and notebook, or a contrast pair's runs and the vector they made."""

from django.conf import settings

from infra.lifecycle import WorkStatus
from playground import plots, scoring
from playground.models import Run, RunKind
from playground.steering import exports as steering_exports
from playground.steering import figures as steering_figures
from playground.steering import scrub
from playground.steering import selectors as steering_selectors
from playground.vectors.captures import steered_positions


def group_context(runs: list[Run]) -> dict:
    context = {
        "runs": runs,
        "group": runs[0].group,
        "kind": runs[0].kind,
        "figures": [],
        "mean_delta_definition": scoring.MEAN_DELTA_DEFINITION,
    }
    context["finished"] = all(run.is_finished for run in runs)
    if runs[0].kind == RunKind.CONTRAST:
        context["kind"] = RunKind.CONTRAST
        context["vector"] = next((run.vector for run in runs if run.vector_id), None)
        # The vector is saved just after the second capture succeeds: keep the panel polling
        # until it is there (or a capture failed), or it would never say the vector is ready.
        failed = any(run.status == WorkStatus.FAILED for run in runs)
        context["finished"] = context["finished"] and (context["vector"] is not None or failed)
        return context
    succeeded = [run for run in runs if run.status == WorkStatus.SUCCEEDED]
    baseline = next((run for run in succeeded if run.scale == 0), None)
    context["baseline"] = baseline
    context["notebook"] = steering_exports.steering_notebook(runs, base_url=settings.SITE_URL)
    context["steered"] = [run for run in runs if run.scale != 0]
    context["steering_vector"] = runs[0].vector
    score = steering_selectors.steering_score_for_group(group=runs[0].group)
    context["score"] = score
    compared = {}
    if score is not None and score.status == WorkStatus.SUCCEEDED:
        compared = {entry["run"]: entry for entry in score.results["runs"]}
    context["arms"] = [
        {
            **steering_selectors.steering_arm(run),
            "positions": steered_positions(run),
            "summary": (
                steering_figures.same_token_summary(compared[str(run.pk)])
                if str(run.pk) in compared
                else None
            ),
        }
        for run in runs
    ]
    # The comparison on the same tokens comes once the runs are done: keep polling until it
    # is there whenever there is something to compare.
    expects_score = baseline is not None and len(succeeded) > 1
    context["finished"] = context["finished"] and (
        not expects_score or (score is not None and score.is_finished)
    )
    for run in context["steered"]:
        if str(run.pk) in compared:
            figure = steering_figures.same_token_figure(
                score.results["baseline"]["strings"], compared[str(run.pk)]
            )
            context["figures"].append(plots.figure_entry(f"diff-{run.scale:g}", figure))
    if len(runs) > 2 and context["finished"] and baseline is not None:
        target = runs[0].meta.get("target_token", "")
        by_scale = {entry["scale_entered"]: entry for entry in compared.values()}
        points = steering_figures.sweep_points(
            [(run.scale_entered, run.response) for run in succeeded], target, by_scale
        )
        unit = "scale"
        if runs[0].meta.get("scale_unit") == "typical":
            vector = runs[0].vector
            unit = "scale (× layer's typical norm)"
            if vector is not None and vector.layer_typical_norm:
                unit = (
                    f"scale (× layer {vector.layer}'s typical norm, "
                    f"‖h‖ = {vector.layer_typical_norm:.2f})"
                )
        figure = steering_figures.scale_sweep_figure(points, target, unit)
        context["figures"].insert(0, plots.figure_entry("sweep", figure))
        steps = scrub.sweep_steps(runs, compared)
        # The slider starts at the largest scale: the step whose effect is likeliest seen.
        context["scrub"] = {
            "steps": steps,
            "current": steps[-1],
            "index": len(steps) - 1,
            "script_id": f"scrub-steps-{runs[0].group}",
        }
    return context
