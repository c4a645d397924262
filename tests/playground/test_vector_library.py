"""The vector library beyond contrast prompts (issue 21, item 4): steering from the main
completion form, a capture's mean saved as a vector with its provenance, rename and delete.
The vector maths is checked with numpy on the raw rows of a recorded /v1 capture, decoded
here from the wire format without the project's codec."""

import base64

import numpy as np
import pytest
import zstandard
from django.urls import reverse

from acs_client.codec import decode
from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind, SteeringVector, VectorMethod
from playground.vectors import captures as vectors
from playground.vectors import services as vector_services
from playground.vectors.services import steering_vector_create

from .conftest import HTMX, recorded
from .test_views import finished_run

CAPTURE_REQUEST = {
    "model": "smollm2-135m",
    "prompt": "Hello world, this is",
    "max_tokens": 1,
    "output_residual_stream": [0, 4, 8],
}
# bfloat16 keeps 8 significant bits: a stored vector is within half a unit of the last.
BF16_RELATIVE = 2.0**-8


pytestmark = pytest.mark.usefixtures("listed_model")


def raw_rows(response: dict) -> np.ndarray:
    """The captured residual stream `[layers, tokens, hidden]` read straight off the wire:
    base64, a zstd frame, little-endian bfloat16 bit patterns widened to float32."""
    stream = response["activations"]["residual_stream"]
    words = np.frombuffer(
        zstandard.ZstdDecompressor().decompress(base64.b64decode(stream["data"])), dtype="<u2"
    )
    return (words.astype(np.uint32) << 16).view(np.float32).reshape(stream["shape"])


def assert_stored(vector: SteeringVector, expected: np.ndarray) -> None:
    stored = decode(vector.data)
    assert stored.shape == expected.shape
    assert np.all(np.abs(stored - expected) <= BF16_RELATIVE * np.abs(expected) + 1e-30)
    assert vector.norm == pytest.approx(float(np.linalg.norm(expected.astype(np.float64))), 1e-5)


@pytest.fixture
def capture_run(approved_user):
    return finished_run(
        approved_user, request=dict(CAPTURE_REQUEST), response=recorded("capture.json")
    )


@pytest.fixture
def other_capture(approved_user):
    """A second capture of the same model whose layers came back in another order, so its
    layer 4 is another row of the recorded tensor than the first run's layer 4."""
    return finished_run(
        approved_user,
        request={**CAPTURE_REQUEST, "prompt": "Goodbye", "output_residual_stream": [4, 0, 8]},
        response=recorded("capture.json"),
    )


def library_vector(user, *, name="honesty", layer=3, model="smollm2-135m", hidden=576):
    return steering_vector_create(
        user=user, name=name, model=model, layer=layer, method=VectorMethod.UPLOAD,
        vector=np.linspace(-1, 1, hidden, dtype=np.float32),
    )  # fmt: skip


# -- vector maths ------------------------------------------------------------------------


def test_capture_mean_is_the_mean_of_the_chosen_rows_at_the_layer(capture_run, approved_user):
    rows = raw_rows(recorded("capture.json"))
    vector = vector_services.steering_vector_from_capture(
        user=approved_user, run=capture_run, name="mean", layer=4, positions=[1, 2, 3, 4]
    )
    assert_stored(vector, rows[1, 1:5].astype(np.float64).mean(axis=0).astype(np.float32))
    assert (vector.layer, vector.model, vector.method) == (4, "smollm2-135m", "capture_mean")
    assert vector.details["source"]["run"] == str(capture_run.pk)
    assert vector.details["source"]["positions"] == [1, 2, 3, 4]
    assert "subtracted" not in vector.details


def test_capture_mean_minus_another_runs_mean_at_the_same_layer(
    capture_run, other_capture, approved_user
):
    rows = raw_rows(recorded("capture.json"))
    vector = vector_services.steering_vector_from_capture(
        user=approved_user, run=capture_run, name="diff", layer=4, positions=[2, 3],
        subtract_run=other_capture,
    )  # fmt: skip
    # The other run's layer 4 is its first row; its mean leaves out its first token.
    expected = rows[1, 2:4].astype(np.float64).mean(axis=0) - rows[0, 1:].mean(axis=0)
    assert_stored(vector, expected.astype(np.float32))
    assert vector.details["subtracted"]["run"] == str(other_capture.pk)
    assert vector.details["subtracted"]["positions"] == [1, 2, 3, 4]


def test_a_layer_the_run_to_subtract_did_not_capture_is_refused(capture_run, approved_user):
    partial = finished_run(
        approved_user,
        request={**CAPTURE_REQUEST, "output_residual_stream": [0, 8, 12]},
        response=recorded("capture.json"),
    )
    with pytest.raises(vectors.CaptureError, match="Layer 4 was not captured"):
        vector_services.steering_vector_from_capture(
            user=approved_user, run=capture_run, name="x", layer=4, positions=[1],
            subtract_run=partial,
        )  # fmt: skip
    assert not SteeringVector.objects.exists()


# -- save from a capture run ---------------------------------------------------------------


def save_url(run):
    return reverse("playground:vector_from_run", args=[run.id])


def test_run_page_offers_to_save_with_positions_labelled_and_the_first_left_out(ada, capture_run):
    page = ada.get(reverse("playground:run_detail", args=[capture_run.id]))
    body = page.content.decode()
    assert "Save as steering vector" in body
    assert 'name="positions"' in body and 'value="1-4"' in body
    assert "leaves out position 0" in body


def test_saving_from_a_run_without_htmx_redirects_to_the_library(ada, capture_run):
    response = ada.post(
        save_url(capture_run), {"name": "greeting", "layer": "8", "positions": "1-4"}
    )
    assert response.status_code == 302 and response.url.endswith("/playground/#vectors")
    vector = SteeringVector.objects.get(name="greeting")
    assert_stored(vector, raw_rows(recorded("capture.json"))[2, 1:5].mean(axis=0))
    library = ada.get(reverse("playground:page")).content.decode()
    assert "greeting" in library and "Mean of a capture" in library
    assert f"/playground/runs/{capture_run.id}/" in library and "positions 1, 2, 3, 4" in library


def test_saving_from_a_run_with_htmx_answers_in_place_and_refreshes_the_library(
    ada, capture_run, other_capture
):
    response = ada.post(
        save_url(capture_run),
        {"name": "contrast", "layer": "4", "positions": "1, 3", "subtract_run": other_capture.pk},
        **HTMX,
    )
    body = response.content.decode()
    assert response.status_code == 200 and "<html" not in body
    assert "Saved <strong>contrast</strong>" in body
    assert "vectorsChanged" in response.headers["HX-Trigger"]
    vector = SteeringVector.objects.get(name="contrast")
    assert vector.details["subtracted"]["run"] == str(other_capture.pk)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"name": "x", "layer": "4", "positions": "0-9"}, "0-9 is outside 0–4"),
        ({"name": "x", "layer": "4", "positions": "2, 2"}, "2 is listed more than once"),
        ({"name": "x", "layer": "4", "positions": "one"}, "is not a number or a range"),
        ({"name": "x", "layer": "5", "positions": "1"}, "Select a valid choice"),
        ({"name": "", "layer": "4", "positions": "1"}, "This field is required"),
    ],
)
def test_save_form_errors_are_shown_next_to_the_field(ada, capture_run, data, message):
    htmx = ada.post(save_url(capture_run), data, **HTMX)
    assert htmx.status_code == 200 and message in htmx.content.decode()
    plain = ada.post(save_url(capture_run), data)
    assert plain.status_code == 400 and message in plain.content.decode()
    assert not SteeringVector.objects.exists()


def test_subtracting_a_capture_without_the_layer_is_a_field_error(ada, capture_run):
    partial = finished_run(
        capture_run.user,
        request={**CAPTURE_REQUEST, "output_residual_stream": [0, 8, 12]},
        response=recorded("capture.json"),
    )
    response = ada.post(
        save_url(capture_run),
        {"name": "x", "layer": "4", "positions": "1", "subtract_run": partial.pk},
        **HTMX,
    )
    assert "Layer 4 was not captured" in response.content.decode()
    assert not SteeringVector.objects.exists()


def test_another_users_runs_can_be_neither_saved_nor_subtracted(ada, capture_run, other_user):
    theirs = finished_run(
        other_user, request=dict(CAPTURE_REQUEST), response=recorded("capture.json")
    )
    data = {"name": "x", "layer": "4", "positions": "1"}
    assert ada.post(save_url(theirs), data).status_code == 404
    response = ada.post(save_url(capture_run), {**data, "subtract_run": theirs.pk})
    assert response.status_code == 400 and "Select a valid choice" in response.content.decode()
    assert not SteeringVector.objects.exists()


def test_a_run_without_a_capture_cannot_be_saved(ada, approved_user):
    run = finished_run(approved_user)
    response = ada.post(save_url(run), {"name": "x", "layer": "0", "positions": "1"})
    assert response.status_code == 404


# -- rename and delete ---------------------------------------------------------------------


def rename(client, vector, name, **headers):
    url = reverse("playground:vector_rename", args=[vector.pk])
    return client.post(url, {f"rename-{vector.pk}-name": name}, **headers)


def test_rename_with_htmx_refreshes_the_library_and_without_redirects(ada, approved_user):
    vector = library_vector(approved_user)
    response = rename(ada, vector, "candour", **HTMX)
    assert response.status_code == 204 and "vectorsChanged" in response.headers["HX-Trigger"]
    vector.refresh_from_db()
    assert vector.name == "candour"
    response = rename(ada, vector, "frankness")
    assert response.status_code == 302 and response.url.endswith("#vectors")
    vector.refresh_from_db()
    assert vector.name == "frankness"


@pytest.mark.parametrize(
    "name, message",
    [("", "This field is required"), ("x" * 101, "at most 100 characters")],
)
def test_rename_errors_are_shown_next_to_the_name(ada, approved_user, name, message):
    vector = library_vector(approved_user)
    htmx = rename(ada, vector, name, **HTMX)
    assert htmx.status_code == 200 and message in htmx.content.decode()
    assert 'id="vectors"' in htmx.content.decode()
    plain = rename(ada, vector, name)
    assert plain.status_code == 400 and message in plain.content.decode()
    vector.refresh_from_db()
    assert vector.name == "honesty"


def test_delete_asks_for_confirmation_then_deletes(ada, approved_user):
    vector = library_vector(approved_user)
    url = reverse("playground:vector_delete", args=[vector.pk])
    confirm = ada.get(url)
    assert confirm.status_code == 200 and "Delete the vector “honesty”?" in confirm.content.decode()
    assert SteeringVector.objects.filter(pk=vector.pk).exists()
    response = ada.post(url, **HTMX)
    assert response.status_code == 204 and "vectorsChanged" in response.headers["HX-Trigger"]
    assert not SteeringVector.objects.filter(pk=vector.pk).exists()


def test_runs_that_used_a_deleted_vector_stay_readable(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    ada.post(
        reverse("playground:steer"),
        {"steer-vector": vector.pk, "steer-prompt": "I think", "steer-scale_unit": "absolute",
         "steer-scales": "2", "steer-max_tokens": 4, "steer-temperature": 0, "steer-seed": 1,
         "steer-logprobs": 2},
    )  # fmt: skip
    steered = Run.objects.get(scale=2.0)
    ada.post(reverse("playground:vector_delete", args=[vector.pk]))
    Run.objects.filter(group=steered.group).update(
        status=WorkStatus.SUCCEEDED, response=recorded("steer_steered.json")
    )
    steered.refresh_from_db()
    assert steered.vector is None and steered.meta["vector_name"] == "honesty"
    # The request still holds the vector's values, so the run can be read and re-run.
    assert steered.request["apply_steering_vectors"][0]["layer_indices"] == [3]
    assert ada.get(reverse("playground:run_detail", args=[steered.id])).status_code == 200
    group = ada.get(reverse("playground:group_detail", args=[steered.group]))
    assert group.status_code == 200


def test_another_users_vector_cannot_be_renamed_or_deleted(ada, other_user):
    vector = library_vector(other_user)
    assert rename(ada, vector, "mine").status_code == 404
    url = reverse("playground:vector_delete", args=[vector.pk])
    assert ada.get(url).status_code == 404
    assert ada.post(url).status_code == 404
    vector.refresh_from_db()
    assert vector.name == "honesty"


# -- steering from the main completion form -------------------------------------------------


def completion(vector=None, **fields):
    data = {"model": "smollm2-135m", "prompt": "I think that", "max_tokens": 4, "seed": 3}
    if vector is not None:
        data["steer_vector"] = vector.pk
    return {**data, **fields}


def test_completion_form_steers_with_a_library_vector(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    response = ada.post(
        reverse("playground:run_submit"),
        completion(vector, steer_layers="3, 7", steer_scale="-2.5"),
        **HTMX,
    )
    assert response.status_code == 200
    run = Run.objects.get()
    assert run.kind == RunKind.COMPLETION and run.vector == vector and run.scale == -2.5
    (steering,) = run.request["apply_steering_vectors"]
    assert steering["layer_indices"] == [3, 7] and steering["scale"] == -2.5
    rows = decode(steering["activations"])
    original = np.linspace(-1, 1, 576, dtype=np.float32)
    assert rows.shape == (2, 576)
    assert np.all(np.abs(rows - original) <= BF16_RELATIVE * np.abs(original))
    page = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "Steered with <strong>honesty</strong> × -2.5 at layers 3, 7" in page


def test_steering_defaults_to_the_vectors_own_layer(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user, layer=9)
    ada.post(reverse("playground:run_submit"), completion(vector, steer_scale="4"))
    assert Run.objects.get().request["apply_steering_vectors"][0]["layer_indices"] == [9]


def test_without_a_vector_nothing_is_steered(ada, no_enqueue):
    ada.post(reverse("playground:run_submit"), completion(steer_scale="4"))
    run = Run.objects.get()
    assert "apply_steering_vectors" not in run.request and run.vector is None


def test_steering_controls_are_collapsed_until_used(ada, approved_user):
    library_vector(approved_user)
    page = ada.get(reverse("playground:page")).content.decode()
    assert '<details id="completion-steering"' in page
    opening = page.split('<details id="completion-steering"')[1].split(">")[0]
    assert " open" not in opening


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"steer_scale": ""}, "steer_scale", "Give the scale to steer with."),
        ({"steer_scale": "5000"}, "steer_scale", "Within ±1000."),
        (
            {"steer_scale": "4", "steer_layers": "30"},
            "steer_layers",
            "Layer 30 in &#x27;Layers&#x27; is out of range; this model has layers 0–29.",
        ),
        ({"steer_scale": "4", "steer_layers": "3, 3"}, "steer_layers", "3 is listed more"),
    ],
)
def test_steering_field_errors(ada, approved_user, fields, field, message):
    vector = library_vector(approved_user)
    response = ada.post(reverse("playground:run_submit"), completion(vector, **fields), **HTMX)
    body = response.content.decode()
    assert message in body.split(f'id="id_{field}"')[1]
    assert (
        '<details id="completion-steering"' in body
        and "open>" in body.split('<details id="completion-steering"')[1].split("<summary>")[0]
    )
    assert not Run.objects.exists()
    plain = ada.post(reverse("playground:run_submit"), completion(vector, **fields))
    assert plain.status_code == 400 and message in plain.content.decode()


def test_layers_without_a_vector_and_a_vector_of_another_model_are_refused(ada, approved_user):
    response = ada.post(
        reverse("playground:run_submit"), completion(steer_layers="3", steer_scale="4")
    )
    assert (
        response.status_code == 400 and "Pick a vector to steer with" in response.content.decode()
    )
    other_model = library_vector(approved_user, model="llama-8b", hidden=4096)
    response = ada.post(reverse("playground:run_submit"), completion(other_model, steer_scale="4"))
    assert response.status_code == 400 and "was made for llama-8b" in response.content.decode()
    assert not Run.objects.exists()


def test_another_users_vector_cannot_steer(ada, other_user):
    theirs = library_vector(other_user)
    response = ada.post(reverse("playground:run_submit"), completion(theirs, steer_scale="4"))
    assert response.status_code == 400 and "Select a valid choice" in response.content.decode()
    assert not Run.objects.exists()


def test_edit_and_rerun_keeps_the_steering(ada, approved_user, no_enqueue):
    vector = library_vector(approved_user)
    ada.post(
        reverse("playground:run_submit"), completion(vector, steer_layers="5", steer_scale="6")
    )
    run = Run.objects.get()
    page = ada.get(reverse("playground:run_edit", args=[run.id])).content.decode()
    steering = page.split('<details id="completion-steering"')[1].split("</details>")[0]
    assert f'<option value="{vector.pk}" selected>' in steering
    assert 'value="5"' in steering and 'value="6.0"' in steering


def test_the_jobs_completion_form_does_not_steer():
    from api.request_forms import ModelCapabilities
    from portal.jobs_forms import CompletionJobForm

    form = CompletionJobForm(models=[], capabilities=ModelCapabilities(None))
    assert "steer_vector" not in form.fields
