"""Reads of the playground: a user's runs and vectors (404 for anyone else's) and code that
reproduces a run's request."""

import json
import pprint
import shlex

from django.http import Http404

from acs_client.protocol import CompletionFields
from playground.models import Run, RunKind

# Runs of activation patching grids, which have their own pages (`patching.views`).
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


def run_for_request(*, user, request_id: str) -> Run | None:
    """The user's run that sent the /v1 request `request_id`, if one did."""
    return Run.objects.filter(user=user, request_id=request_id).only("id").first()


def _python_literal(value) -> str:
    return pprint.pformat(value, sort_dicts=False, width=88)


def run_code_snippets(run: Run, *, base_url: str) -> dict[str, str]:
    """Code that sends exactly the run's request: curl, the openai SDK (non-OpenAI fields go
    in extra_body) and acs_client, which also reads the numbers the run page draws."""
    request = run.request  # the body exactly as sent, its keys in their order
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
    streamed = run.body.stream
    if streamed:
        openai += (
            "for chunk in response:\n    print(chunk.choices[0].text if chunk.choices else chunk)\n"
        )
    else:
        openai += "print(response.choices[0].text)\n"
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
        acs += _figure_lines(run.body)
    return {"curl": curl, "openai": openai, "acs_client": acs}


def _figure_lines(request: CompletionFields) -> str:
    """acs_client lines that send `request` and read, from its answer, the numbers the run
    page's figures draw (each only where the request asked for it)."""
    lines = [
        "answer = client.completions(body)",
        'choice = answer.body["choices"][0]',
        'print(choice["text"])',
    ]
    if request.logprobs is not None:
        lines += [
            "# Token view and top-k: each generated token, its logprob (nats), alternatives.",
            'probabilities = np.exp(choice["logprobs"]["token_logprobs"])',
        ]
    if request.prompt_logprobs is not None and request.return_token_ids:
        lines += [
            "# Prompt surprisal: −logprob (nats) of each prompt token after the first.",
            'entries, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]',
            'surprisal = [-entries[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]',
        ]
    if request.output_residual_stream:
        lines += [
            "# Activation views: the residual stream [layers, tokens, hidden] and ‖h‖.",
            "residual = answer.residual_stream()",
            "norms = np.linalg.norm(residual, axis=-1)",
        ]
    return "".join(line + "\n" for line in lines)
