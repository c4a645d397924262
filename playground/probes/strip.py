"""A saved probe read out on a capture run: at each captured position, the probe's decision
function (the log-odds of its positive class) of the residual stream at the probe's layer,
labelled by the position's token. The probe was fitted on pooled texts; here it is applied
to every position's own row."""

import numpy as np
from django.http import Http404

from playground import captures

from ..models import Run, SteeringVector, VectorMethod
from .fitting import decision


def probe_vectors_for_run(run: Run, capture: captures.Capture) -> list[SteeringVector]:
    """The run's user's saved probes of the run's model at a layer the run captured."""
    return list(
        SteeringVector.objects.filter(
            user=run.user_id,
            method=VectorMethod.LINEAR_PROBE,
            model=run.body.model,
            layer__in=capture.layers,
        ).order_by("-created_at")
    )


def _colour(score: float, largest: float) -> str:
    """Blue for the positive class, red for the other, white at 0 (log-odds)."""
    share = min(abs(score) / largest, 1.0) if largest > 0 else 0.0
    fade = round(255 * (1 - 0.75 * share))
    return f"rgb({fade},{fade},255)" if score > 0 else f"rgb(255,{fade},{fade})"


def score_strip(capture: captures.Capture, vector: SteeringVector) -> dict:
    """The strip of `vector` (a saved probe) over the capture: per position its label,
    score and colour."""
    rows = capture.tensor[capture.layers.index(vector.layer)]
    scores = decision(rows, vector.details)
    largest = float(np.abs(scores).max()) if scores.size else 0.0
    return {
        "vector": vector,
        "positive_class": vector.details.get("positive_class"),
        "classes": vector.details.get("classes"),
        "cells": [
            {
                "position": position,
                "label": label,
                "score": float(score),
                "probability": float(1 / (1 + np.exp(-score))),
                "colour": _colour(float(score), largest),
            }
            for position, (label, score) in enumerate(zip(capture.labels, scores, strict=True))
        ],
    }


def score_strip_section(run: Run, capture: captures.Capture, vector_id=None) -> dict | None:
    """The run page's score-strip section: the probes it can show and the strip of the one
    picked (`vector_id`; the newest by default); None when the user saved no probe of this
    model at a captured layer. 404 for a `vector_id` not among them."""
    vectors = probe_vectors_for_run(run, capture)
    if not vectors:
        return None
    picked = vectors[0]
    if vector_id is not None:
        picked = next((vector for vector in vectors if str(vector.pk) == str(vector_id)), None)
        if picked is None:
            raise Http404("No such saved probe for this run's model and captured layers.")
    return {"run": run, "vectors": vectors, "strip": score_strip(capture, picked)}
