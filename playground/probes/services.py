"""Writes of the linear probes: creating a probe, the worker's steps (submitting its harvest
through /v1 with the user's playground key, following it without holding a worker, then
pooling and fitting), cancelling, the stuck sweep, and saving a layer's probe as a vector.

A probe's worker never waits on the harvest: `probe_submit` sends it and queues
`probe_follow` with a countdown, which reads the job once and queues itself again until the
job has ended. Each step writes through the claim's `Attempt`, so a cancel (or the sweep)
makes every later write of that worker change nothing."""

import datetime as dt
import tempfile
import uuid

import numpy as np
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import playground_key_get_or_create, worker_secret
from acs_client.client import AcsApiError, AcsClient
from acs_client.downloads import load_activations
from infra.lifecycle import ACTIVE, Attempt, WorkStatus, work_claim, work_sweep
from infra.once import created_once
from infra.tasks import TaskQueueUnreachable, task_send, task_send_on_commit
from playground.vectors.services import steering_vector_create

from ..models import SteeringVector, VectorMethod
from . import fitting
from .datasets import Dataset
from .models import Probe

PROBE_SUBMIT_TASK = "playground.probes.tasks.probe_submit_task"
PROBE_FOLLOW_TASK = "playground.probes.tasks.probe_follow_task"
PROBE_HARVEST_CANCEL_TASK = "playground.probes.tasks.probe_harvest_cancel_task"
# How often the worker reads a running harvest's status.
FOLLOW_EVERY_S = 1
# A running probe whose worker has not written for this long lost it (the sweep fails it).
LEASE = dt.timedelta(minutes=10)


def harvest_request(probe: Probe) -> dict:
    """The POST /v1/harvest body of a probe: every text, the probe's layers."""
    return {
        "model": probe.model,
        "prompts": probe.dataset["texts"],
        "layers": probe.layers,
        "add_special_tokens": True,
    }


def probe_create(
    *,
    user: User,
    model: str,
    dataset: Dataset,
    layers: list[int],
    pooling: str,
    seed: int,
    test_fraction: float,
    regularisation_c: float,
    token_cost: int,
    submit_token: uuid.UUID | None = None,
) -> Probe:
    """Store a queued probe and enqueue its harvest's submission once the transaction
    commits. The same `submit_token` again returns the first probe."""

    def create() -> Probe:
        with transaction.atomic():
            playground_key_get_or_create(user=user)
            probe = Probe.objects.create(
                user=user,
                model=model,
                dataset={"texts": dataset.texts, "labels": dataset.labels},
                n_rows=len(dataset.texts),
                dataset_sha256=dataset.sha256,
                classes=dataset.classes,
                layers=layers,
                pooling=pooling,
                seed=seed,
                test_fraction=test_fraction,
                regularisation_c=regularisation_c,
                token_cost=token_cost,
                submit_token=submit_token,
            )
            task_send_on_commit(
                PROBE_SUBMIT_TASK,
                str(probe.id),
                unsent=lambda error: _probe_refuse_unsent(probe=probe, error=error),
            )
        return probe

    return created_once(Probe, user=user, submit_token=submit_token, create=create)


def _probe_refuse_unsent(*, probe: Probe, error: TaskQueueUnreachable) -> None:
    Probe.objects.filter(pk=probe.pk, status=WorkStatus.QUEUED).update(
        status=WorkStatus.FAILED,
        error_code=error.code,
        error_message=str(error),
        submit_token=None,
        finished_at=timezone.now(),
    )


def _client(probe: Probe) -> AcsClient:
    return AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(probe.user))


def _end(attempt: Attempt, status: str, *, code: str, message: str) -> None:
    attempt.write(
        status=status,
        error_code=code,
        error_message=message,
        finished_at=timezone.now(),
        lease_expires_at=None,
    )


def probe_submit(*, probe_id) -> Probe | None:
    """Claim a queued probe and submit its harvest (the probe's id as Idempotency-Key, so a
    resend never makes a second job), then queue `probe_follow`. When the API asks to retry
    within PLAYGROUND_RUN_MAX_RETRY_DELAY, the probe goes back to queued and its task is sent
    again after that delay (`Attempt.requeue`), up to PLAYGROUND_RUN_MAX_RETRIES times; a
    refusal fails the probe with the API's code and message. None if not claimed."""
    attempt = work_claim(Probe, pk=probe_id, now=timezone.now(), lease=LEASE)
    if attempt is None:
        return None
    probe = Probe.objects.select_related("user").get(pk=probe_id)
    client = _client(probe)
    try:
        job = client.submit_harvest(harvest_request(probe), idempotency_key=str(probe.id))
    except AcsApiError as error:
        countdown = error.retry_in(at_most=settings.PLAYGROUND_RUN_MAX_RETRY_DELAY)
        if countdown is not None and attempt.number <= settings.PLAYGROUND_RUN_MAX_RETRIES:
            attempt.requeue(
                task=PROBE_SUBMIT_TASK, delay_s=countdown, lease=LEASE, now=timezone.now()
            )
            return probe
        _end(attempt, WorkStatus.FAILED, code=error.code, message=error.message)
        return probe
    if not attempt.write(harvest_job_id=job.job_id, stage="harvest"):
        # Cancelled while the harvest was being submitted: nothing else will stop it.
        probe_harvest_cancel(probe=probe, job_id=job.job_id)
        return probe
    task_send(PROBE_FOLLOW_TASK, str(probe.id), countdown=FOLLOW_EVERY_S)
    return probe


def probe_follow(*, probe_id) -> None:
    """One look at a running probe's harvest: still running, renew the lease and look again
    in FOLLOW_EVERY_S; failed or cancelled, end the probe with the job's error; done,
    download its shards, pool them and fit every layer (`probe_fit`)."""
    probe = Probe.objects.select_related("user").filter(pk=probe_id).first()
    if probe is None or probe.status != WorkStatus.RUNNING or probe.harvest_job_id is None:
        return
    attempt = Attempt.of(probe)
    client = _client(probe)
    now = timezone.now()
    try:
        job = client.harvest(str(probe.harvest_job_id))
    except AcsApiError as error:
        if error.should_retry and attempt.heartbeat(lease=LEASE, now=now):
            task_send(PROBE_FOLLOW_TASK, str(probe.id), countdown=FOLLOW_EVERY_S)
        elif not error.should_retry:
            _end(attempt, WorkStatus.FAILED, code=error.code, message=error.message)
        return
    if not job.ended:
        if attempt.heartbeat(lease=LEASE, now=now, prompts_done=job.prompts_done):
            task_send(PROBE_FOLLOW_TASK, str(probe.id), countdown=FOLLOW_EVERY_S)
        return
    if job.status != "done":
        error = job.error
        code = error.code if error else job.status
        message = error.message if error else (job.message or f"The harvest job {job.status}.")
        status = WorkStatus.CANCELLED if job.status == "cancelled" else WorkStatus.FAILED
        _end(attempt, status, code=code, message=f"The harvest job {job.status}: {message}")
        return
    if not attempt.heartbeat(lease=LEASE, now=now, prompts_done=job.prompts_done, stage="fit"):
        return
    try:
        with tempfile.TemporaryDirectory(prefix="probe-") as directory:
            download = client.download_harvest(job, directory)
            features = _pooled_features(probe, download.shard_paths)
    except (AcsApiError, ValueError, KeyError) as error:
        message = error.message if isinstance(error, AcsApiError) else str(error)
        _end(
            attempt,
            WorkStatus.FAILED,
            code="harvest_unreadable",
            message=f"The harvest's files could not be read: {message}",
        )
        return
    probe_fit(attempt=attempt, probe=probe, features=features)


def _pooled_features(probe: Probe, shard_paths) -> np.ndarray:
    """`[texts, layers, hidden]` float64: each text's capture pooled at the probe's layers,
    one shard in memory at a time."""
    rows = []
    for path in shard_paths:
        for capture in load_activations(path).captures:
            stacked = np.stack([capture.layer(layer) for layer in probe.layers])
            rows.append(fitting.pooled(stacked, probe.pooling))
    if len(rows) != probe.n_rows:
        raise ValueError(f"The harvest holds {len(rows)} captures for {probe.n_rows} texts.")
    return np.stack(rows)


def probe_fit(*, attempt: Attempt, probe: Probe, features: np.ndarray) -> None:
    """Fit every layer (see `fitting`), writing the layers done so far as it goes; stops at
    the first write refused (the probe was cancelled), else ends the probe succeeded."""
    labels = np.array([probe.classes.index(label) for label in probe.dataset["labels"]])
    train, test = fitting.split(labels, test_fraction=probe.test_fraction, seed=probe.seed)
    counts = fitting.bootstrap_counts(len(test), probe.seed)
    results = {
        "split": {"train": len(train), "test": len(test), "test_rows": test.tolist()},
        "bootstrap": {"resamples": fitting.BOOTSTRAP_RESAMPLES, "seed": probe.seed},
        "layers": [],
    }
    weights = {}
    for index, layer in enumerate(probe.layers):
        numbers, fitted = fitting.layer_results(
            features[:, index, :], labels, train=train, test=test,
            c=probe.regularisation_c, seed=probe.seed, counts=counts,
        )  # fmt: skip
        results["layers"].append({"layer": layer, **numbers})
        weights[str(layer)] = fitted
        if not attempt.heartbeat(lease=LEASE, now=timezone.now(), results=results):
            return
    attempt.write(
        status=WorkStatus.SUCCEEDED,
        results=results,
        weights=weights,
        finished_at=timezone.now(),
        lease_expires_at=None,
    )


def probe_cancel(*, probe: Probe) -> bool:
    """Cancel a queued or running probe: its worker's later writes change nothing, and its
    harvest, if submitted, is cancelled through the API (a task, after commit); a harvest
    still being submitted is cancelled by its own worker. False if it had already ended."""
    with transaction.atomic():
        cancelled = Probe.objects.filter(pk=probe.pk, status__in=ACTIVE).update(
            status=WorkStatus.CANCELLED,
            finished_at=timezone.now(),
            lease_expires_at=None,
        )
        probe.refresh_from_db()
        if cancelled and probe.harvest_job_id is not None:
            task_send_on_commit(PROBE_HARVEST_CANCEL_TASK, str(probe.pk), unsent=lambda _: None)
    return bool(cancelled)


def probe_harvest_cancel(*, probe: Probe, job_id=None) -> None:
    """DELETE the probe's harvest job through /v1 (an already ended job is left as it is)."""
    try:
        _client(probe).cancel_harvest(str(job_id or probe.harvest_job_id))
    except AcsApiError as error:
        if error.code != "harvest_not_cancellable":
            raise


def probes_fail_stuck(*, now=None) -> int:
    """Fail probes whose worker stopped writing (running past their lease) or that no worker
    took within PLAYGROUND_RUN_STUCK_SECONDS. Run by beat with the runs sweep."""
    now = now or timezone.now()
    return work_sweep(
        Probe,
        running_lost=Q(lease_expires_at__lt=now),
        queued_lost=Q(
            created_at__lt=now - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS)
        ),
        message=lambda _probe, _code: "The worker fitting this probe stopped; submit it again.",
        now=now,
    )


def probe_vector_save(*, probe: Probe, layer: int, name: str) -> SteeringVector:
    """Save `layer`'s probe direction (`fitting.direction`) in the user's vector library,
    with its provenance and what scoring needs (`fitting.decision`) in `details`."""
    numbers = next(entry for entry in probe.results["layers"] if entry["layer"] == layer)
    weights = probe.weights[str(layer)]
    details = {
        "probe": str(probe.pk),
        "dataset_sha256": probe.dataset_sha256,
        "rows": probe.n_rows,
        "classes": probe.classes,
        "positive_class": probe.positive_class,
        "layer": layer,
        "pooling": probe.pooling,
        "split": {key: probe.results["split"][key] for key in ("train", "test")},
        "test_fraction": probe.test_fraction,
        "seed": probe.seed,
        "C": probe.regularisation_c,
        "test_accuracy": numbers["accuracy"],
        "test_auroc": numbers["auroc"],
        "score": "decision(h) = coef · (h − mean) / scale + intercept: the log-odds of the "
        "positive class; the vector itself is coef / scale",
        **weights,
    }
    return steering_vector_create(
        user=probe.user,
        name=name,
        model=probe.model,
        layer=layer,
        method=VectorMethod.LINEAR_PROBE,
        vector=fitting.direction(weights),
        details=details,
    )
