"""Celery tasks of the playground: thin, ids in; the work is in `services`."""

from celery import shared_task

from infra.lifecycle import WorkStatus
from playground.compare import services as compare
from playground.patching import services as patching
from playground.runs.execution import run_execute
from playground.runs.services import groups_dispatch_stalled, runs_fail_stuck
from playground.steering.services import steering_score_execute, steering_scores_fail_stuck

from .models import RunKind


@shared_task(acks_late=True)
def run_execute_task(run_id: str) -> None:
    """Execute one playground run (re-sent by the service after a transient API error)."""
    run = run_execute(run_id=run_id)
    # A patching grid's patched runs follow its captures; started here because patching's
    # services build their runs with the runs' services (the runs do not import patching).
    if (
        run is not None
        and run.kind == RunKind.PATCHING_CAPTURE
        and run.status == WorkStatus.SUCCEEDED
    ):
        patching.patched_runs_create_or_fail(group=run.group)


@shared_task(acks_late=True)
def steering_score_execute_task(score_id: str) -> None:
    """Compare a steering comparison's runs on the same tokens (teacher-forced requests)."""
    steering_score_execute(score_id=score_id)


@shared_task(acks_late=True)
def run_comparison_execute_task(comparison_id: str) -> None:
    """Score two runs on each other's tokens (teacher-forced requests; see `compare`)."""
    compare.comparison_execute(comparison_id=comparison_id)


@shared_task
def runs_sweep_task() -> int:
    """Fail playground runs and same-token comparisons stuck in queued or running (see
    `runs_fail_stuck`, `steering_scores_fail_stuck` and `compare.comparisons_fail_stuck`),
    resume patching
    grids stalled between their captures and their patched runs, and send the next runs of
    groups whose dispatch stalled. Returns how many it failed."""
    patching.patching_grids_resume_stalled()
    groups_dispatch_stalled()
    return runs_fail_stuck() + steering_scores_fail_stuck() + compare.comparisons_fail_stuck()
