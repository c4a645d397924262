"""Reads of steering comparisons and sweeps: a group's runs, its same-token score, and
what each arm sent."""

from django.http import Http404

from playground.models import Run, SteeringScore
from playground.runs.selectors import OWN_PAGE_KINDS


def group_runs_for_user(*, user, group) -> list[Run]:
    """The runs of one comparison, sweep or contrast pair, ordered by scale; 404 if none."""
    runs = sorted(
        Run.objects.filter(group=group, user=user).exclude(kind__in=OWN_PAGE_KINDS),
        key=lambda run: (run.scale if run.scale is not None else 0, run.meta.get("role", "")),
    )
    if not runs:
        raise Http404("No such comparison.")
    return runs


def steering_score_for_group(*, group) -> SteeringScore | None:
    """The same-token comparison of a steering comparison or sweep, if one was queued."""
    return SteeringScore.objects.filter(group=group).first()


def steering_arm(run: Run) -> dict:
    """What one arm of a steering comparison sent: its prompt, the steering applied (layers,
    prompt positions or None for every position, scale as entered and as sent, norm_match)
    and the sampling settings."""
    request = run.body
    steering = request.steering
    return {
        "run": run,
        "prompt": request.prompts()[0],
        "layers": steering.layer_indices if steering else [],
        "position_indices": steering.position_indices if steering else None,
        "scale_sent": steering.scale if steering else 1.0,
        "scale_entered": run.scale_label or "0",
        "norm_match": steering.norm_match if steering else False,
        "seed": request.seed,
        "temperature": request.temperature,
        "max_tokens": request.max_tokens,
        "logprobs": request.logprobs,
    }
