"""vLLM-Lens's captures (testsupport/vllm_lens.py: the server `make test` started, or one of its
own) give a logit lens and attribution within the float32 model's bounds: the checks of
test_lens_fidelity.py on one request sent in the upstream dialect, tokens named by id. Run by
`make test-vllm` (it needs .venv-vllm), not by `make test-engine`."""

from reference_model import cpu_description
from test_lens_fidelity import REQUEST, lens_problems

from acs_client.protocol import in_vllm_xargs
from tests.tolerances import WIDEST


def test_vllm_lens_captures_give_the_float32_models_lens_and_attribution(
    vllm_lens, float32_reference, lens_weights
):
    # Tokens named by id: vLLM names a token that is part of a character ambiguously.
    body = {**REQUEST, "return_tokens_as_token_ids": True}
    response = vllm_lens.post("/v1/completions", json=in_vllm_xargs(body))
    assert response.status_code == 200, response.text
    problems = lens_problems(response.json(), float32_reference, lens_weights, WIDEST)
    assert not problems, (
        f"{len(problems)} discrepancies of vLLM-Lens on {cpu_description()} "
        f"(bounds: {WIDEST}):\n" + "\n".join(problems[:20])
    )
