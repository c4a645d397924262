"""Celery tasks of the playground: thin, ids in; the work is in `services`."""

from celery import shared_task

from infra.lifecycle import WorkStatus
from playground.compare import services as compare
from playground.patching import services as patching
from playground.runs.execution import run_execute
from playground.runs.services import groups_dispatch_stalled, runs_fail_stuck
from playground.steering.services import steering_score_execute, steering_scores_fail_stuck

from .models import RunKind
from .patchscopes.services import patchscope_runs_create_or_fail, patchscopes_resume_stalled
from .probes import tasks as probe_tasks  # noqa: F401 (Celery registers its tasks)
from .probes.services import probes_fail_stuck


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
    # A Patchscope's generations follow the capture of its inspection prompt.
    if (
        run is not None
        and run.kind == RunKind.PATCHSCOPE_CAPTURE
        and run.status == WorkStatus.SUCCEEDED
    ):
        patchscope_runs_create_or_fail(patchscope_id=run.group)


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
    """Fail playground runs, same-token comparisons and probes stuck in queued or running (see
    `runs_fail_stuck`, `steering_scores_fail_stuck`, `compare.comparisons_fail_stuck` and
    `probes_fail_stuck`), resume patching grids stalled between their captures and their
    patched runs (and Patchscopes between their capture and their generations), and send the
    next runs of groups whose dispatch stalled. Returns how many it failed."""
    patching.patching_grids_resume_stalled()
    patchscopes_resume_stalled()
    groups_dispatch_stalled()
    return (
        runs_fail_stuck()
        + steering_scores_fail_stuck()
        + compare.comparisons_fail_stuck()
        + probes_fail_stuck()
    )
