"""The numbers of a probe, as pure functions over numpy arrays (scikit-learn for the fit).

- Features: per text, the residual stream at each layer pooled over its positions: the last
  token's row, or the mean of the rows after the first (position 0's row, an attention sink,
  is left out).
- Split: one stratified held-out split for every layer,
  `train_test_split(indices, test_size=test_fraction, stratify=labels, random_state=seed)`.
- Probe: `StandardScaler` then `LogisticRegression(C=C)` (L2, lbfgs) in one pipeline, fitted
  on the training split. Standardising inside the pipeline: the residual stream has a few
  dimensions hundreds of times larger than the rest, which would otherwise take the whole L2
  penalty and slow lbfgs; the scaler is fitted on the training rows only, so nothing of the
  held-out rows leaks into the probe.
- Control: the same pipeline fitted on the training labels shuffled
  (`default_rng(seed).permutation`), scored on the true held-out labels; selectivity =
  accuracy − control accuracy.
- Baseline: always answering the training split's majority class (AUROC 0.5 by definition).
- Intervals: 95% percentile bootstrap over the held-out rows, `BOOTSTRAP_RESAMPLES` resamples
  drawn once (`default_rng(seed).integers(0, n_test, (resamples, n_test))`) and shared by
  every layer and by the control; an AUROC resample holding one class only is left out.
"""

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.95
# lbfgs iterations: standardised features of a few thousand rows converge in far fewer.
MAX_ITERATIONS = 5000


def pooled(activations: np.ndarray, pooling: str) -> np.ndarray:
    """`[layers, hidden]` float64 from one text's `[layers, tokens, hidden]` capture."""
    if pooling == "last":
        return activations[:, -1, :].astype(np.float64)
    return activations[:, 1:, :].astype(np.float64).mean(axis=1)


def split(labels: np.ndarray, *, test_fraction: float, seed: int):
    """The training and held-out row indices (stratified by label)."""
    return train_test_split(
        np.arange(len(labels)), test_size=test_fraction, stratify=labels, random_state=seed
    )


def probe_pipeline(c: float) -> Pipeline:
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=MAX_ITERATIONS))


def bootstrap_counts(n_test: int, seed: int) -> np.ndarray:
    """`[resamples, n_test]`: how often each held-out row is drawn in each resample."""
    draws = np.random.default_rng(seed).integers(0, n_test, size=(BOOTSTRAP_RESAMPLES, n_test))
    counts = np.zeros((BOOTSTRAP_RESAMPLES, n_test))
    np.add.at(counts, (np.arange(BOOTSTRAP_RESAMPLES)[:, None], draws), 1)
    return counts


def interval(values: np.ndarray) -> list[float]:
    tail = 100 * (1 - CONFIDENCE) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def accuracy_interval(correct: np.ndarray, counts: np.ndarray) -> list[float]:
    return interval(counts @ correct.astype(np.float64) / counts.shape[1])


def auroc_interval(scores: np.ndarray, labels: np.ndarray, counts: np.ndarray) -> list[float]:
    """AUROC of each resample as the weighted share of (positive, negative) pairs ordered
    right (ties count half), the weights how often each row was drawn."""
    positive, negative = labels == 1, labels == 0
    difference = scores[positive][:, None] - scores[negative][None, :]
    ordered = (difference > 0) + 0.5 * (difference == 0)
    weights_pos, weights_neg = counts[:, positive], counts[:, negative]
    pairs = weights_pos.sum(axis=1) * weights_neg.sum(axis=1)
    kept = pairs > 0
    right = np.einsum("bi,ij,bj->b", weights_pos[kept], ordered, weights_neg[kept])
    return interval(right / pairs[kept])


def _scored(pipeline: Pipeline, features, labels, counts) -> dict:
    predicted = pipeline.predict(features)
    scores = pipeline.decision_function(features)
    correct = predicted == labels
    return {
        "accuracy": float(correct.mean()),
        "accuracy_ci": accuracy_interval(correct, counts),
        "auroc": float(roc_auc_score(labels, scores)),
        "auroc_ci": auroc_interval(scores, labels, counts),
    }


def layer_results(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    train: np.ndarray,
    test: np.ndarray,
    c: float,
    seed: int,
    counts: np.ndarray,
) -> tuple[dict, dict]:
    """One layer's numbers (accuracy, AUROC and their intervals, the control's, selectivity,
    the baseline) and its fitted probe (`coef` in standardised units, `intercept`, and the
    scaler's `mean` and `scale`: decision(h) = coef · (h − mean) / scale + intercept, the
    log-odds of the positive class)."""
    probe = probe_pipeline(c).fit(features[train], labels[train])
    shuffled = np.random.default_rng(seed).permutation(labels[train])
    control = probe_pipeline(c).fit(features[train], shuffled)
    held_out = labels[test]
    numbers = _scored(probe, features[test], held_out, counts)
    controlled = _scored(control, features[test], held_out, counts)
    majority = int(np.bincount(labels[train], minlength=2).argmax())
    numbers.update(
        {
            "control_accuracy": controlled["accuracy"],
            "control_accuracy_ci": controlled["accuracy_ci"],
            "control_auroc": controlled["auroc"],
            "control_auroc_ci": controlled["auroc_ci"],
            "selectivity": numbers["accuracy"] - controlled["accuracy"],
            "baseline_accuracy": float((held_out == majority).mean()),
            "baseline_accuracy_ci": accuracy_interval(held_out == majority, counts),
            "train_accuracy": float(probe.score(features[train], labels[train])),
        }
    )
    scaler, regression = (
        probe.named_steps["standardscaler"],
        probe.named_steps["logisticregression"],
    )
    weights = {
        "coef": regression.coef_[0].tolist(),
        "intercept": float(regression.intercept_[0]),
        "mean": scaler.mean_.tolist(),
        "scale": scaler.scale_.tolist(),
    }
    return numbers, weights


def decision(rows: np.ndarray, weights: dict) -> np.ndarray:
    """The probe's decision function (log-odds of the positive class) of each `[hidden]` row."""
    mean, scale = np.asarray(weights["mean"]), np.asarray(weights["scale"])
    return ((rows.astype(np.float64) - mean) / scale) @ np.asarray(weights["coef"]) + weights[
        "intercept"
    ]


def direction(weights: dict) -> np.ndarray:
    """The probe's direction in the residual stream's own units, coef / scale (float32): one
    unit along it moves the decision function by its squared norm."""
    return (np.asarray(weights["coef"]) / np.asarray(weights["scale"])).astype(np.float32)
