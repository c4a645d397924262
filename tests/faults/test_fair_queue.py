"""One user's big grid or sweep does not hold up everyone else's playground (issue 36.3): a
group's runs go to the workers PLAYGROUND_GROUP_RUNS_IN_FLIGHT at a time, so that another
account's run waits for a few of them, not all."""

import uuid

from django.db import transaction
from django.utils import timezone

from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind
from playground.runs.services import run_create, run_enqueue

from .conftest import STUB_MODEL, make_account, wait_for

GRID_CELLS = 512
START_BOUND_S = 2.0
BODY = {"model": STUB_MODEL, "prompt": "the capital of france is", "max_tokens": 2}


def _grid(user) -> uuid.UUID:
    """A group of GRID_CELLS runs queued at once, as a patching grid queues its cells."""
    group = uuid.uuid4()
    with transaction.atomic():
        for cell in range(GRID_CELLS):
            run_enqueue(
                user=user,
                request=BODY,
                kind=RunKind.PATCHED,
                group=group,
                vector=None,
                meta={"layer": 0, "position": cell},
                submit_token=None,
            )
    return group


def test_another_accounts_run_starts_within_2_s_while_a_512_cell_grid_runs(
    system, account, fault_table, playground_sends_to_system
):
    group = _grid(account.user)
    try:
        wait_for(
            lambda: Run.objects.filter(group=group, status=WorkStatus.SUCCEEDED).count() >= 8,
            timeout=60,
            what="the grid to run",
        )
        other = make_account()
        submitted = timezone.now()
        run = run_create(user=other.user, request=BODY)
        started = wait_for(
            lambda: Run.objects.filter(pk=run.pk, started_at__isnull=False).first(),
            timeout=60,
            what="the other account's run to start",
            interval=0.02,
        )
        waited = (started.started_at - submitted).total_seconds()
        cells_left = Run.objects.filter(group=group, status=WorkStatus.QUEUED).count()
        finished = wait_for(
            lambda: Run.objects.filter(pk=run.pk, finished_at__isnull=False).first(),
            timeout=60,
            what="the other account's run to finish",
        )
        assert finished.status == WorkStatus.SUCCEEDED, finished.error_message
    finally:
        # The grid's remaining cells would keep the worker busy for the next tests.
        Run.objects.filter(group=group, status=WorkStatus.QUEUED).update(
            status=WorkStatus.FAILED, finished_at=timezone.now()
        )
        wait_for(
            lambda: not Run.objects.filter(group=group, status=WorkStatus.RUNNING).exists(),
            timeout=60,
            what="the grid's last cells to end",
        )
    print(
        f"\nanother account's run started {waited:.2f} s after its submit, {cells_left} cells left"
    )
    assert cells_left > GRID_CELLS / 2, "the grid was still running"
    assert waited <= START_BOUND_S
    fault_table.add(
        fault=f"a {GRID_CELLS}-cell grid of one account queued at once",
        client_saw=f"another account's run started {waited:.2f} s after its submit",
        metered="—",
        produced=f"{cells_left} of the grid's cells still waiting",
        recovery="—",
    )
