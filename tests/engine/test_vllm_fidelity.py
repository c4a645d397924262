"""vLLM-Lens (testsupport/vllm_lens.py: the server `make test` started, or one of its own) answers
as the float32 model, within the bounds the engine is held to in bfloat16: the cases of
test_fidelity.py, sent in the upstream dialect as the gateway sends them. Run by `make
test-vllm` (it needs .venv-vllm), not by `make test-engine`."""

import pytest
from reference_model import cpu_description
from test_fidelity import CASES, discrepancies

from acs_client.protocol import in_vllm_xargs
from tests.tolerances import TOLERANCES
from testsupport.vllm_lens import MODEL


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_vllm_lens_answers_as_the_float32_model(vllm_lens, float32_reference, case):
    # Tokens named by id: vLLM reports a token that is part of a character as "", or as the
    # character its previous tokens complete, which no string-to-id lookup can tell apart.
    body = {
        "model": MODEL,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        **case.body,
    }
    response = vllm_lens.post("/v1/completions", json=in_vllm_xargs(body))
    assert response.status_code == 200, response.text
    bound = TOLERANCES["bfloat16"]
    problems = discrepancies(case, response.json(), float32_reference, bound)
    assert not problems, (
        f"{len(problems)} discrepancies of vLLM-Lens on {cpu_description()} "
        f"(bounds: {bound}):\n" + "\n".join(problems[:20])
    )
