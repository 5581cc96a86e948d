"""Champion vs challenger: evaluate two registered versions on one held-out set, compare them,
and act on a reviewer's decision (move the ``champion`` alias, or tag the version rejected).

Airflow-free (the review DAG's tasks call it through ``plugins.review``): everything here runs
from a shell against any MLflow tracking server. Both versions are evaluated through
``mlflow.pyfunc`` exactly as a serving job would load them, on the *challenger's* test split
(the shards its training run read, named by the version's ``dataset.shards_prefix`` tag), so
the two numbers are comparable. mlflow, mxnet and matplotlib are imported inside functions.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.tracking.registry import CHALLENGER_ALIAS, bounded_mlflow_env
from training.tracking.run_extras import confusion_png

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
REVIEW_EXPERIMENT = "mxnet-pipeline-review"
# Version tags that carry the lineage and the decision.
SHARDS_TAG = "dataset.shards_prefix"
REVIEW_TAG = "review"
REVIEWER_TAG = "review.reviewer"
COMMENT_TAG = "review.comment"
REVIEW_RUN_TAG = "review.run_id"
MAX_TAG_VALUE = 5000  # MLflow's model-version tag value limit


class ReviewError(ValueError):
    """A review cannot be done as asked (no such version, no test data, incompatible models)."""


@dataclass(frozen=True)
class Target:
    """What one review compares: a registered model's challenger and its champion (if any)."""

    name: str
    challenger: str
    champion: str | None
    shards_prefix: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "challenger": self.challenger, "champion": self.champion,
                "shards_prefix": self.shards_prefix}


# ---------------------------------------------------------------- pure helpers (unit-tested)


def confusion(truth: Sequence[Any], predicted: Sequence[Any], classes: Sequence[Any]) -> list[list[int]]:
    """``m[i][j]``: examples of ``classes[i]`` predicted as ``classes[j]``.

    Compared as strings: class values come back from JSON, CSV and pandas with different types
    (``3``, ``3.0``, ``"3"``); a prediction outside ``classes`` is an error, not a silent miss.
    """
    index = {_key(c): i for i, c in enumerate(classes)}
    if len(truth) != len(predicted):
        raise ValueError(f"{len(truth)} labels but {len(predicted)} predictions")
    unknown = sorted({_key(p) for p in predicted} - index.keys())
    if unknown:
        raise ReviewError(f"model predicts classes {unknown[:10]} that the test data does not have "
                          f"({[_key(c) for c in classes][:20]})")
    m = [[0] * len(classes) for _ in classes]
    for t, p in zip(truth, predicted):
        m[index[_key(t)]][index[_key(p)]] += 1
    return m


def _key(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def scores(matrix: Sequence[Sequence[int]], classes: Sequence[Any]) -> dict[str, Any]:
    """Accuracy and per-class accuracy (recall) from a confusion matrix."""
    n = sum(sum(row) for row in matrix)
    correct = sum(matrix[i][i] for i in range(len(matrix)))
    per_class = {_key(c): (matrix[i][i] / sum(matrix[i]) if sum(matrix[i]) else None)
                 for i, c in enumerate(classes)}
    return {"accuracy": correct / n if n else None, "num_examples": n, "per_class_accuracy": per_class,
            "confusion_matrix": [list(r) for r in matrix], "classes": [_key(c) for c in classes]}


def comparison(challenger: Mapping[str, Any], champion: Mapping[str, Any] | None) -> dict[str, Any]:
    """Side by side: overall and per-class accuracy of both, and the challenger's gain."""
    def delta(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    champ_pc = champion["per_class_accuracy"] if champion else {}
    rows = [{"class": c, "challenger": a, "champion": champ_pc.get(c), "delta": delta(a, champ_pc.get(c))}
            for c, a in challenger["per_class_accuracy"].items()]
    return {
        "accuracy": {"challenger": challenger["accuracy"], "champion": champion["accuracy"] if champion else None,
                     "delta": delta(challenger["accuracy"], champion["accuracy"] if champion else None)},
        "per_class": rows,
        "num_examples": challenger["num_examples"],
    }


def markdown(target: Target, comp: Mapping[str, Any]) -> str:
    """The comparison as the Markdown the reviewer reads in Airflow's approval form."""
    def pct(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:.2f}%"

    def signed(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:+.2f} pp"

    champ = f"version {target.champion}" if target.champion else "none yet"
    acc = comp["accuracy"]
    lines = [f"**{target.name}**: challenger version {target.challenger} vs champion {champ}, "
             f"on {comp['num_examples']} held-out test rows (`{target.shards_prefix}`).", "",
             "| | challenger | champion | Δ |", "|---|---|---|---|",
             f"| accuracy | {pct(acc['challenger'])} | {pct(acc['champion'])} | {signed(acc['delta'])} |"]
    lines += [f"| class {r['class']} | {pct(r['challenger'])} | {pct(r['champion'])} | {signed(r['delta'])} |"
              for r in comp["per_class"]]
    if not target.champion:
        lines += ["", "There is no champion yet: approving makes this version the first one."]
    return "\n".join(lines)


# ---------------------------------------------------------------- MLflow side


def client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _alias_version(mlflow_client: Any, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow_client.get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def resolve_target(tracking_uri: str, name: str, version: str | None = None,
                   shards_prefix: str | None = None) -> Target:
    """The version to review (``version``, else the ``challenger`` alias) and the current champion."""
    with bounded_mlflow_env():
        c = client(tracking_uri)
        challenger = str(version) if version else _alias_version(c, name, CHALLENGER_ALIAS)
        if challenger is None:
            raise ReviewError(f"{name} has no version with alias {CHALLENGER_ALIAS!r}; name a version")
        mv = c.get_model_version(name, challenger)
        prefix = shards_prefix or mv.tags.get(SHARDS_TAG)
        if not prefix:
            raise ReviewError(f"{name} version {challenger} has no {SHARDS_TAG!r} tag: pass the test data's "
                              "shards prefix")
        return Target(name=name, challenger=challenger, champion=_alias_version(c, name, CHAMPION_ALIAS),
                      shards_prefix=prefix)


def load_test_split(shards_prefix: str, work_dir: str) -> tuple[Any, list[Any], list[str], list[Any]]:
    """The test split of a sharded dataset: features ``[n, f]``, label *values*, columns, classes."""
    import numpy as np

    from training.feed import data

    manifest = data.load_manifest(shards_prefix)
    test = [s for s in manifest["shards"] if s["split"] == "test"]
    X, y = data.fetch_split(manifest, shards_prefix, test, work_dir)
    if len(y) == 0:
        raise ReviewError(f"{shards_prefix} has no test rows to review on")
    classes = list(manifest["classes"])
    values = np.asarray(classes, dtype=object)[np.asarray(y, dtype=np.int64)].tolist()
    return X, values, list(manifest["feature_columns"]), classes


def evaluate_version(tracking_uri: str, name: str, version: str, X: Any, truth: Sequence[Any],
                     columns: Sequence[str], classes: Sequence[Any]) -> dict[str, Any]:
    """Load a registered version through ``mlflow.pyfunc`` and score it on ``(X, truth)``."""
    import mlflow.pyfunc
    import pandas as pd

    with bounded_mlflow_env():
        model = mlflow.pyfunc.load_model(f"models:/{name}/{version}")
    frame = pd.DataFrame(X.astype("float64"), columns=list(columns))
    try:
        predicted = model.predict(frame)["label"].tolist()
    except Exception as exc:  # a champion trained on other features cannot be compared
        raise ReviewError(f"{name} version {version} cannot score the test data: {exc}") from exc
    return scores(confusion(truth, predicted, classes), classes)


def review(tracking_uri: str, target: Target, *, run_name: str, tags: Mapping[str, str] | None = None) -> dict:
    """Evaluate both versions, log the comparison to a review run; returns it with its Markdown."""
    with tempfile.TemporaryDirectory(prefix="mxpipe-review-") as tmp:
        X, truth, columns, classes = load_test_split(target.shards_prefix, os.path.join(tmp, "data"))
        results = {"challenger": evaluate_version(tracking_uri, target.name, target.challenger, X, truth,
                                                  columns, classes)}
        if target.champion:
            results["champion"] = evaluate_version(tracking_uri, target.name, target.champion, X, truth,
                                                   columns, classes)
        comp = comparison(results["challenger"], results.get("champion"))
        text = markdown(target, comp)
        report = {"target": target.to_dict(), "comparison": comp, "results": results}
        files = {"comparison.json": os.path.join(tmp, "comparison.json"),
                 "comparison.md": os.path.join(tmp, "comparison.md")}
        with open(files["comparison.json"], "w") as f:
            json.dump(report, f, indent=2)
        with open(files["comparison.md"], "w") as f:
            f.write(text + "\n")
        for role, result in results.items():
            png = confusion_png(result, f"{role} (version {getattr(target, role)})",
                                os.path.join(tmp, f"confusion_{role}.png"))
            if png:
                files[f"confusion_{role}.png"] = png
        run_id = _log_review_run(tracking_uri, target, comp, files, run_name, dict(tags or {}))
    log.info("review of %s version %s (run %s):\n%s", target.name, target.challenger, run_id, text)
    return {"target": target.to_dict(), "comparison": comp, "markdown": text, "review_run_id": run_id}


def _log_review_run(tracking_uri: str, target: Target, comp: Mapping[str, Any], files: Mapping[str, str],
                    run_name: str, tags: dict[str, str]) -> str:
    from mlflow.entities import Metric

    from training.tracking.mlflow_params import MAX_METRICS_PER_BATCH, chunked
    from training.tracking.registry import _get_or_create_experiment

    with bounded_mlflow_env():
        c = client(tracking_uri)
        exp = _get_or_create_experiment(c, REVIEW_EXPERIMENT)
        run = c.create_run(exp, run_name=run_name, tags={
            **tags, "model.name": target.name, "model.challenger": target.challenger,
            "model.champion": target.champion or ""})
        rid = run.info.run_id
        c.log_batch(rid, params=[_param("model.name", target.name), _param("challenger", target.challenger),
                                 _param("champion", target.champion or "none"),
                                 _param("shards_prefix", target.shards_prefix)], synchronous=True)
        metrics = [Metric(f"{role}.accuracy", v, 0, 0) for role, v in comp["accuracy"].items() if v is not None]
        metrics += [Metric(f"{role}.class_{r['class']}.accuracy", r[role], 0, 0)
                    for r in comp["per_class"] for role in ("challenger", "champion", "delta")
                    if r[role] is not None]
        for batch in chunked(metrics, MAX_METRICS_PER_BATCH):
            c.log_batch(rid, metrics=batch, synchronous=True)
        for path in files.values():
            c.log_artifact(rid, path, artifact_path="review")
        c.set_terminated(rid, "FINISHED")
    return rid


def _param(key: str, value: str) -> Any:
    from mlflow.entities import Param

    return Param(key, value)


def _decision_tags(decision: str, reviewer: str, comment: str, review_run_id: str | None) -> dict[str, str]:
    tags = {REVIEW_TAG: decision, REVIEWER_TAG: reviewer or "unknown", COMMENT_TAG: comment[:MAX_TAG_VALUE]}
    if review_run_id:
        tags[REVIEW_RUN_TAG] = review_run_id
    return tags


def promote(tracking_uri: str, name: str, version: str, *, reviewer: str, comment: str = "",
            review_run_id: str | None = None) -> dict[str, Any]:
    """Move ``champion`` to ``version`` and tag it approved; returns the previous champion."""
    with bounded_mlflow_env():
        c = client(tracking_uri)
        previous = _alias_version(c, name, CHAMPION_ALIAS)
        for key, value in _decision_tags("approved", reviewer, comment, review_run_id).items():
            c.set_model_version_tag(name, version, key, value)
        c.set_registered_model_alias(name, CHAMPION_ALIAS, version)
    log.info("%s: champion %s -> %s (approved by %s)", name, previous, version, reviewer)
    return {"name": name, "champion": version, "previous_champion": previous}


def reject(tracking_uri: str, name: str, version: str, *, reviewer: str, comment: str = "",
           review_run_id: str | None = None) -> dict[str, Any]:
    """Tag ``version`` rejected (with the reviewer's comment); the aliases stay as they are."""
    with bounded_mlflow_env():
        c = client(tracking_uri)
        for key, value in _decision_tags("rejected", reviewer, comment, review_run_id).items():
            c.set_model_version_tag(name, version, key, value)
        champion = _alias_version(c, name, CHAMPION_ALIAS)
    log.info("%s version %s rejected by %s: %s (champion stays %s)", name, version, reviewer, comment, champion)
    return {"name": name, "rejected": version, "champion": champion}
