"""Reads of the linear probes: a user's probe (404 for another's), the latest one, and what
the page and the downloads show of it."""

from django.http import Http404

from . import fitting
from .figures import probe_figures
from .models import Pooling, Probe

DEFINITIONS = {
    "accuracy": "share of held-out rows whose predicted class is their label",
    "auroc": "area under the ROC curve of the probe's decision function on the held-out rows",
    "intervals": f"95% percentile bootstrap over the held-out rows: "
    f"{fitting.BOOTSTRAP_RESAMPLES} resamples, numpy default_rng(seed).integers(0, n_test, "
    "(resamples, n_test)), shared by every layer and the control; an AUROC resample of one "
    "class is left out",
    "control": "the same pipeline fitted on the training labels shuffled "
    "(numpy default_rng(seed).permutation), scored on the true held-out labels",
    "selectivity": "accuracy − control accuracy",
    "baseline_accuracy": "always answering the training split's majority class",
    "probe": "StandardScaler then LogisticRegression(C, L2, lbfgs) fitted on the training rows",
    "split": "train_test_split(row indices, test_size=test_fraction, stratify=labels, "
    "random_state=seed)",
    "pooling": "last: the last token's residual stream; mean: the mean over positions 1 on",
    "dataset_sha256": "SHA-256 of the rows as JSON Lines {label, text}, sorted keys",
}
# The columns of the table and the CSV, one row per layer.
COLUMNS = (
    "layer", "accuracy", "accuracy_ci", "auroc", "auroc_ci", "control_accuracy",
    "control_accuracy_ci", "control_auroc", "control_auroc_ci", "selectivity",
    "baseline_accuracy", "baseline_accuracy_ci", "train_accuracy",
)  # fmt: skip


# What the page never shows: up to MAX_DATASET_BYTES of texts, and every layer's fitted probe.
LARGE_FIELDS = ("dataset", "weights")


def probe_for_user(*, user, probe_id) -> Probe:
    probe = Probe.objects.defer(*LARGE_FIELDS).filter(user=user, pk=probe_id).first()
    if probe is None:
        raise Http404("No such probe.")
    return probe


def latest_probe_for_user(*, user) -> Probe | None:
    return Probe.objects.defer(*LARGE_FIELDS).filter(user=user).first()


def probe_layers_fitted(probe: Probe) -> list[dict]:
    return (probe.results or {}).get("layers") or []


def probe_export(probe: Probe) -> dict:
    """Every number of the probe with its definitions and provenance."""
    results = probe.results or {}
    return {
        "probe": str(probe.pk),
        "status": probe.status,
        "model": probe.model,
        "dataset_sha256": probe.dataset_sha256,
        "rows": probe.n_rows,
        "classes": probe.classes,
        "positive_class": probe.positive_class,
        "pooling": probe.pooling,
        "seed": probe.seed,
        "test_fraction": probe.test_fraction,
        "C": probe.regularisation_c,
        "harvest_job": str(probe.harvest_job_id) if probe.harvest_job_id else None,
        "token_cost": probe.token_cost,
        "split": results.get("split"),
        "bootstrap": results.get("bootstrap"),
        "definitions": DEFINITIONS,
        "layers": [
            {column: entry[column] for column in COLUMNS} for entry in probe_layers_fitted(probe)
        ],
    }


def probe_context(probe: Probe) -> dict:
    """The probe panel: its progress, figures and table."""
    fitted = probe_layers_fitted(probe)
    return {
        "probe": probe,
        "fitted": fitted,
        "figures": probe_figures(fitted) if fitted else [],
        "export": probe_export(probe),
        "pooling_label": Pooling(probe.pooling).label,
        "definitions": DEFINITIONS,
    }
