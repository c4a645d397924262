"""What the scrubber of a finished sweep shows at each scale: the data the sweep page embeds
(json_script) so that its slider changes the text, the same-token figure shown and the scale
marked on the dose–response chart in place, with no request."""

from django.urls import reverse

from infra.lifecycle import WorkStatus
from playground.models import Run
from playground.steering import figures as steering_figures


def sweep_steps(runs: list[Run], compared: dict[str, dict]) -> list[dict]:
    """One step per run of the sweep, by scale as entered: the scale (the sweep chart's x),
    its label, the run's first choice's text (or its error), the name of its same-token
    figure and the means of that comparison in nats per token (`compared`: run id → entry of
    `SteeringScore.results["runs"]`; None where it has none, as at the baseline)."""
    steps = []
    for run in sorted(runs, key=lambda run: run.scale_entered or 0.0):
        entry = compared.get(str(run.pk))
        summary = steering_figures.same_token_summary(entry) if entry else None
        succeeded = run.status == WorkStatus.SUCCEEDED
        steps.append(
            {
                "run": str(run.pk),
                "url": reverse("playground:run_detail", args=[run.pk]),
                "scale": run.scale_entered or 0.0,
                "label": f"{run.scale_label} (steered)" if run.scale else "0 (baseline)",
                "text": run.response["choices"][0]["text"] if succeeded else "",
                "error": "" if succeeded else f"{run.error_code}: {run.error_message}",
                "figure": f"diff-{run.scale:g}" if entry else None,
                "mean_delta": summary["delta_baseline_tokens"] if summary else None,
                "mean_kl": summary["kl"] if summary else None,
            }
        )
    return steps
