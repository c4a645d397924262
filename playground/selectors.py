"""Reads of the playground: a user's runs and vectors (404 for anyone else's) and code that
reproduces a run's request."""

import datetime as dt
import json
import pprint
import shlex

from django.http import Http404
from django.utils import timezone

from .models import (
    JobSubmission,
    Run,
    RunKind,
    SteeringScore,
    SteeringVector,
    WorkStatus,
)

# Runs of activation patching grids, which have their own pages (`patching_views`).
PATCHING_KINDS = (RunKind.PATCHING_CAPTURE, RunKind.PATCHED)
# Runs with pages of their own: patching grids', steering evaluations' and Patchscopes'.
OWN_PAGE_KINDS = (
    *PATCHING_KINDS,
    RunKind.STEERING_EVAL,
    RunKind.PATCHSCOPE_CAPTURE,
    RunKind.PATCHSCOPE,
)

OPENAI_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs",
    "echo", "stream", "stream_options",
}  # fmt: skip


def runs_listed(*, user, kind: str = ""):
    """The user's runs of `kind` (any when empty), newest first, without the (possibly large)
    response. Listing any kind leaves out a patching grid's cells: a grid has up to hundreds,
    which would bury every other run; its capture runs link to the grid, which has them all."""
    runs = Run.objects.filter(user=user).defer("response")
    return runs.filter(kind=kind) if kind else runs.exclude(kind=RunKind.PATCHED)


def runs_for_user(*, user, limit: int = 50) -> list[Run]:
    """The user's latest runs as `runs_listed` lists them."""
    return list(runs_listed(user=user)[:limit])


def latest_run_for_user(*, user, kind: str) -> Run | None:
    """The user's latest run of `kind`, if any."""
    return Run.objects.filter(user=user, kind=kind).first()


def latest_group_for_user(*, user):
    """The group of the user's latest comparison, sweep or contrast pair, if any (patching
    grids have their own page)."""
    return (
        Run.objects.filter(user=user, group__isnull=False)
        .exclude(kind__in=OWN_PAGE_KINDS)
        .values_list("group", flat=True)
        .first()
    )


def run_for_user(*, user, run_id) -> Run:
    """The run, or 404 when it does not exist or belongs to someone else."""
    run = Run.objects.filter(pk=run_id, user=user).first()
    if run is None:
        raise Http404("No such run.")
    return run


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
    request = run.request
    prompt = request.get("prompt", "")
    steering = (request.get("apply_steering_vectors") or [{}])[0]
    return {
        "run": run,
        "prompt": prompt[0] if isinstance(prompt, list) else prompt,
        "layers": steering.get("layer_indices") or [],
        "position_indices": steering.get("position_indices"),
        "scale_sent": steering.get("scale", 1.0),
        "scale_entered": run.scale_label or "0",
        "norm_match": bool(steering.get("norm_match", False)),
        "seed": request.get("seed"),
        "temperature": request.get("temperature", 1.0),
        "max_tokens": request.get("max_tokens"),
        "logprobs": request.get("logprobs"),
    }


def vectors_for_user(*, user) -> list[SteeringVector]:
    return list(SteeringVector.objects.filter(user=user).defer("data"))


def vector_for_user(*, user, vector_id) -> SteeringVector:
    vector = SteeringVector.objects.filter(pk=vector_id, user=user).first()
    if vector is None:
        raise Http404("No such vector.")
    return vector


# How long the Jobs page keeps showing a submission the API refused.
REFUSED_SUBMISSION_SHOWN = dt.timedelta(days=1)


def job_submissions_shown(*, user, limit: int = 10) -> list[JobSubmission]:
    """The user's Jobs-page submissions still on their way to /v1, and those the API refused
    in the last day (with its error), newest first. Submitted ones are listed as jobs."""
    return list(
        JobSubmission.objects.filter(user=user)
        .exclude(status=WorkStatus.SUCCEEDED)
        .exclude(
            status=WorkStatus.FAILED,
            created_at__lt=timezone.now() - REFUSED_SUBMISSION_SHOWN,
        )
        .defer("request")[:limit]
    )


def _python_literal(value) -> str:
    return pprint.pformat(value, sort_dicts=False, width=88)


def run_code_snippets(request: dict, *, base_url: str) -> dict[str, str]:
    """Code that sends exactly `request`: curl, the openai SDK (non-OpenAI fields go in
    extra_body) and acs_client, which also reads the numbers the run page draws."""
    body = json.dumps(request)
    curl = (
        f"curl {shlex.quote(base_url + '/v1/completions')} \\\n"
        '  -H "Authorization: Bearer $ACS_API_KEY" \\\n'
        "  -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(body)}"
    )
    standard = {k: v for k, v in request.items() if k in OPENAI_FIELDS}
    extra = {k: v for k, v in request.items() if k not in OPENAI_FIELDS}
    arguments = "".join(f"    {key}={_python_literal(value)},\n" for key, value in standard.items())
    if extra:
        arguments += f"    extra_body={_python_literal(extra)},\n"
    openai = (
        "import os\n\nfrom openai import OpenAI\n\n"
        f'client = OpenAI(base_url="{base_url}/v1", api_key=os.environ["ACS_API_KEY"])\n'
        f"response = client.completions.create(\n{arguments})\n"
    )
    if request.get("stream"):
        openai += (
            "for chunk in response:\n    print(chunk.choices[0].text if chunk.choices else chunk)\n"
        )
    else:
        openai += "print(response.choices[0].text)\n"
    streamed = request.get("stream")
    acs = (
        "import os\n\n"
        + ("" if streamed else "import numpy as np\n")
        + "from acs_client.client import AcsClient\n\n"
        f'client = AcsClient(base_url="{base_url}", api_key=os.environ["ACS_API_KEY"])\n'
        f"body = {_python_literal(request)}\n"
    )
    if streamed:
        acs += (
            "with client.stream_completions(body) as stream:\n"
            "    for frame in stream:\n"
            "        print(frame)\n"
        )
    else:
        acs += _figure_lines(request)
    return {"curl": curl, "openai": openai, "acs_client": acs}


def _figure_lines(request: dict) -> str:
    """acs_client lines that send `request` and read, from its answer, the numbers the run
    page's figures draw (each only where the request asked for it)."""
    lines = [
        "answer = client.completions(body)",
        'choice = answer.body["choices"][0]',
        'print(choice["text"])',
    ]
    if request.get("logprobs") is not None:
        lines += [
            "# Token view and top-k: each generated token, its logprob (nats), alternatives.",
            'probabilities = np.exp(choice["logprobs"]["token_logprobs"])',
        ]
    if request.get("prompt_logprobs") is not None and request.get("return_token_ids"):
        lines += [
            "# Prompt surprisal: −logprob (nats) of each prompt token after the first.",
            'entries, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]',
            'surprisal = [-entries[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]',
        ]
    if request.get("output_residual_stream"):
        lines += [
            "# Activation views: the residual stream [layers, tokens, hidden] and ‖h‖.",
            "residual = answer.residual_stream()",
            "norms = np.linalg.norm(residual, axis=-1)",
        ]
    return "".join(line + "\n" for line in lines)
