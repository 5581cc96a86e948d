"""What a training run's MLflow page shows beyond params, metrics and the model.

The dataset manifest as an ``mlflow.data`` input (so the run's "Datasets used" names the exact
shards it trained on, by digest), a loss/accuracy curve built from the epoch history (the
test split's confusion matrix and per-class figures come from MLflow's evaluator:
``training.tracking.evaluation``) and, for regression, a predicted-vs-true plot of the test split. Airflow-free; mlflow and matplotlib are imported inside the
functions (matplotlib missing: no image, a log line, nothing fails).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

DATASET_CONTEXT = "train"
# Metrics the curve plots when the history has them: losses on the left axis, accuracies right.
LOSS_KEYS = ("train_loss", "val_loss")
ACCURACY_KEYS = ("train_accuracy", "val_accuracy", "val_r2")


def dataset_source(uri: str) -> Any:
    """The ``mlflow.data`` source for a URI (``s3://`` or a local path)."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source

    with warnings.catch_warnings():
        # A local path matches two registered local sources that are the same class: noise.
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
        return resolve_dataset_source(uri)


def manifest_dataset(manifest: Mapping[str, Any], manifest_uri: str, digest: str) -> Any:
    """An ``mlflow.data`` MetaDataset for a shard manifest: its source is the manifest's URI,
    its digest the manifest digest (the lineage key the registry tags carry too)."""
    from mlflow.data.meta_dataset import MetaDataset

    source = dataset_source(manifest_uri)
    name = str(manifest.get("source_uri") or manifest_uri).rstrip("/").rsplit("/", 1)[-1] or "dataset"
    # MLflow caps the digest at 36 characters.
    return MetaDataset(source=source, name=name, digest=digest[:36])


def log_dataset_input(manifest: Mapping[str, Any], manifest_uri: str, digest: str) -> None:
    """Attach the manifest to the active (fluent) run; MLflow keeps one input per name+digest,
    so a retried attempt logging it again adds nothing."""
    import mlflow

    mlflow.log_input(manifest_dataset(manifest, manifest_uri, digest), context=DATASET_CONTEXT,
                     tags={"shards_prefix": manifest_uri.rsplit("/", 1)[0],
                           "source_fingerprint": str(manifest.get("source_fingerprint", ""))})


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on workers
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plots on the MLflow run")
        return None
    return plt


def curves_png(history: Sequence[Mapping[str, float]], path: str) -> str | None:
    """Loss and accuracy per epoch as one PNG; ``None`` with no history or no matplotlib."""
    plt = _pyplot()
    if plt is None or not history:
        return None
    epochs = [int(row.get("epoch", i)) for i, row in enumerate(history)]
    fig, loss_ax = plt.subplots(figsize=(6, 4), dpi=100)
    acc_ax = loss_ax.twinx()
    for ax, keys, style in ((loss_ax, LOSS_KEYS, "-"), (acc_ax, ACCURACY_KEYS, "--")):
        for key in keys:
            if any(key in row for row in history):
                ax.plot(epochs, [row.get(key, float("nan")) for row in history], style, marker="o",
                        markersize=3, label=key)
    loss_ax.set(xlabel="epoch", ylabel="loss", title="training curves")
    acc_ax.set(ylabel="R²" if any("val_r2" in row for row in history) else "accuracy")
    lines = loss_ax.get_legend_handles_labels()[0] + acc_ax.get_legend_handles_labels()[0]
    if lines:
        fig.legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def predicted_vs_true_png(true: Any, predicted: Any, names: Sequence[str], path: str) -> str | None:
    """Regression's test plot (in place of the confusion matrix): predicted against true value,
    one panel per target, with the diagonal of a perfect model; ``None`` without matplotlib."""
    plt = _pyplot()
    if plt is None or not len(true):
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4.2), dpi=100, squeeze=False)
    for j, (ax, name) in enumerate(zip(axes[0], names)):
        t, p = true[:, j], predicted[:, j]
        low, high = float(min(t.min(), p.min())), float(max(t.max(), p.max()))
        ax.scatter(t, p, s=8, alpha=0.6)
        ax.plot([low, high], [low, high], "k--", linewidth=1, label="predicted = true")
        ax.set(xlabel=f"true {name}", ylabel=f"predicted {name}", title=f"{name} (test split, {len(t)} rows)")
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_artifacts(history: Sequence[Mapping[str, float]], out_dir: str) -> dict[str, str]:
    """``{run-relative artifact path: local PNG}`` for ``log_model_run(artifacts=...)``."""
    os.makedirs(out_dir, exist_ok=True)
    curves = curves_png(history, os.path.join(out_dir, "curves.png"))
    return {"plots/curves.png": curves} if curves else {}
