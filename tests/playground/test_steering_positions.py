"""The completion form and the steering comparison / sweep form offer the API's steering by
position (issue 37, item 5; they steered every position only): positions of the prompt,
checked as the API checks them (not a generated token's, position 0 only with max_tokens 1),
errors listing the prompt's tokens by position, a helper that shows them, and the run and
comparison pages naming the positions steered by their tokens."""

import pytest
from django.urls import reverse

from api.errors import ApiError
from infra.lifecycle import WorkStatus
from playground import fields
from playground.runs import views
from playground.steering import exports as steering_exports

from .conftest import HTMX, MODEL
from .test_patching import word_tokens
from .test_vector_library import library_vector

pytestmark = pytest.mark.django_db

PROMPT = "The capital of France is"
TOKENS = "0 ‘The’ 1 ‘·capital’ 2 ‘·of’ 3 ‘·France’ 4 ‘·is’"


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    tokenize = lambda model_id, texts: [word_tokens(t, s) for t, s in texts]  # noqa: E731
    monkeypatch.setattr(fields, "tokenize", tokenize)
    monkeypatch.setattr(views, "tokenize", tokenize)


def submit(client, vector, headers=HTMX, **fields):
    data = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 4,
            "steer_vector": vector.pk, "steer_scale": "4", **fields}  # fmt: skip
    return client.post(reverse("playground:run_submit"), data, **headers)


def test_the_form_steers_the_prompt_positions_asked_for(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    page = ada.get(reverse("playground:page")).content.decode()
    assert 'name="steer_positions"' in page and "Show the prompt's tokens by position" in page
    response = submit(ada, vector, steer_positions="3-4")
    assert response.status_code == 200
    run = approved_user.playground_runs.get()
    (steering,) = run.request["apply_steering_vectors"]
    assert steering["position_indices"] == [3, 4] and steering["layer_indices"] == [3]
    # The run page says which positions, by their tokens, once its tokens are known.
    prompt = word_tokens(PROMPT, True)
    run.tokens = {"prompts": [{"ids": prompt.ids, "strings": prompt.strings}]}
    run.save(update_fields=["tokens"])
    page = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "at layer 3, at positions 3 ·France, 4 ·is only." in page
    # Edit and re-run keeps them.
    edit = ada.get(reverse("playground:run_edit", args=[run.id])).content.decode()
    assert 'name="steer_positions" value="3-4"' in edit


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"steer_positions": "5"},
            "Position 5 is a generated token&#x27;s; steering by position reaches the "
            "prompt&#x27;s positions only (0–4).",
        ),
        ({"steer_positions": "0, 3"}, "Position 0 would also be steered at every generated"),
        ({"steer_positions": "3-1"}, "Positions: 3-1 is outside 0–8, or a range that runs"),
    ],
)
def test_positions_the_api_would_refuse_are_field_errors_listing_the_tokens(
    ada, approved_user, no_enqueue, fields, message
):
    vector = library_vector(approved_user)
    for headers in (HTMX, {}):
        response = submit(ada, vector, headers, **fields)
        html = response.content.decode()
        assert response.status_code == (200 if headers else 400)
        assert message in html and f"The prompt&#x27;s tokens: {TOKENS}." in html
    assert not approved_user.playground_runs.exists()


def test_position_zero_is_steered_when_one_token_is_generated(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    submit(ada, vector, max_tokens=1, steer_positions="0")
    (steering,) = approved_user.playground_runs.get().request["apply_steering_vectors"]
    assert steering["position_indices"] == [0]


def test_the_prompts_tokens_are_shown_with_and_without_htmx(ada, monkeypatch):
    url = reverse("playground:prompt_tokens")
    partial = ada.get(url, {"model": "smollm2-135m", "prompt": PROMPT}, **HTMX)
    html = partial.content.decode()
    assert partial.status_code == 200 and "<html" not in html
    assert f"By position (· marks a space, ⏎ a newline): {TOKENS}" in html
    page = ada.get(url, {"model": "smollm2-135m", "prompt": PROMPT}).content.decode()
    assert "<html" in page and TOKENS in page

    def unreachable(model_id, texts):
        raise ApiError("tokenizer_unavailable", "no tokenizer")

    monkeypatch.setattr(views, "tokenize", unreachable)
    refused = ada.get(url, {"prompt": PROMPT}, **HTMX).content.decode()
    assert "could not be tokenized (tokenizer_unavailable: no tokenizer)" in refused


def steer(client, vector, headers=HTMX, **fields):
    data = {"steer-vector": vector.pk, "steer-prompt": PROMPT, "steer-scale_unit": "absolute",
            "steer-scales": "2, 4", "steer-max_tokens": 4, "steer-temperature": 0,
            "steer-seed": 1, "steer-logprobs": 2}  # fmt: skip
    data.update({f"steer-{name}": value for name, value in fields.items()})
    return client.post(reverse("playground:steer"), data, **headers)


def test_a_sweep_steers_the_prompt_positions_asked_for_in_every_arm(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    page = ada.get(reverse("playground:page")).content.decode()
    assert 'name="steer-positions"' in page
    assert steer(ada, vector, positions="3-4").status_code == 200
    runs = list(approved_user.playground_runs.order_by("scale"))
    assert [run.scale for run in runs] == [0.0, 2.0, 4.0]
    for run in runs:
        (steering,) = run.request["apply_steering_vectors"]
        assert steering["position_indices"] == [3, 4] and steering["layer_indices"] == [3]
    # The comparison page names them by their tokens in every arm, and its notebook code
    # sends them again.
    prompt = word_tokens(PROMPT, True)
    for run in runs:
        run.tokens = {"prompts": [{"ids": prompt.ids, "strings": prompt.strings}]}
        run.status = WorkStatus.SUCCEEDED
        run.save(update_fields=["tokens", "status"])
    group = reverse("playground:group_detail", args=[runs[0].group])
    html = ada.get(group).content.decode()
    assert html.count("<td>3 ·France, 4 ·is</td>") == 3
    notebook = steering_exports.steering_notebook(runs, base_url="http://testserver")
    assert "POSITIONS = [3, 4]" in notebook and "positions=POSITIONS" in notebook


def test_a_sweep_without_positions_steers_every_position(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    steer(ada, vector)
    for run in approved_user.playground_runs.all():
        assert "position_indices" not in run.request["apply_steering_vectors"][0]


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        ("5", "Position 5 is a generated token&#x27;s"),
        ("0", "Position 0 would also be steered at every generated"),
    ],
)
def test_sweep_positions_the_api_would_refuse_are_field_errors_listing_the_tokens(
    ada, approved_user, no_enqueue, positions, message
):
    vector = library_vector(approved_user)
    for headers in (HTMX, {}):
        html = steer(ada, vector, headers, positions=positions).content.decode()
        assert message in html and f"The prompt&#x27;s tokens: {TOKENS}." in html
    assert not approved_user.playground_runs.exists()


class Counted(int):
    """A position that counts the comparisons and hashes made of it, all of them together,
    and fails the check that makes more than `budget`."""

    ops = 0
    budget = 0

    def _count(self):
        Counted.ops += 1
        if Counted.ops > Counted.budget:
            raise AssertionError(f"more than {Counted.budget:,} comparisons")

    def __eq__(self, other):
        self._count()
        return int.__eq__(self, other)

    def __hash__(self):
        self._count()
        return int.__hash__(self)


def operations(monkeypatch, text: str, count: int) -> int:
    """The comparisons and hashes of positions `fields.position_list` makes reading `text`
    (its ranges made of counted positions), failing past 4 a position."""
    counted_range = lambda start, stop: [Counted(p) for p in range(start, stop)]  # noqa: E731
    Counted.ops, Counted.budget = 0, 4 * count
    with monkeypatch.context() as patched:
        patched.setattr(fields, "range", counted_range, raising=False)
        assert fields.position_list(text, count=count) == list(range(count))
    return Counted.ops


def test_32000_distinct_positions_are_checked_in_linear_operations(monkeypatch):
    """Checking that no position is listed twice took a slice and a scan per position:
    half a billion comparisons for 32,000 positions, seconds of the web loop's CPU."""
    baseline = operations(monkeypatch, "0-999", 1000)
    large = operations(monkeypatch, "0-31999", 32000)
    # Each position counted at least once (the count is real), and linearly: 32 times the
    # 1,000-position baseline, with room to spare.
    assert baseline >= 1000 and 32000 <= large <= 2 * 32 * baseline
    with pytest.raises(fields.forms.ValidationError) as refused:
        fields.position_list("0-31999, 17", count=32000)
    assert refused.value.messages == ["Positions: 17 is listed more than once."]
