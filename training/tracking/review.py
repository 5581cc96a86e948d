"""Champion vs challenger: evaluate two registered versions on one held-out set, compare them,
gate the challenger automatically, and act on a reviewer's decision (move the ``champion``
alias, or tag the version rejected).

Airflow-free (the review DAG's tasks call it through ``plugins.review_tasks``): everything here runs
from a shell against any MLflow tracking server. Both versions are loaded through
``mlflow.pyfunc`` exactly as a serving job would load them and scored with
``mlflow.models.evaluate`` (``training.tracking.evaluation.score_model``, the scoring the training
DAG's register step uses for a new model: the default classifier evaluator's accuracy, precision, recall, F1,
per-class table and confusion matrix) on the *challenger's* test split (the shards its
training run read, named by the version's ``dataset.shards_prefix`` tag), so the two are
comparable. Each evaluation is a run nested in the review run and linked to the version's
LoggedModel (``model_id``), so the model's page in MLflow lists its test metrics too. mlflow,
mxnet, sklearn and matplotlib are imported inside functions.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from training.tracking.evaluation import EvaluationData, EvaluationError, class_key, load_test_split, score_model
from training.tracking.registry import CHALLENGER_ALIAS, logged_model_id
from training.tracking.runs import bounded_mlflow_env, fluent_tracking_uri, get_or_create_experiment

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
REVIEW_EXPERIMENT = "mxnet-pipeline-review"
# Version tags that carry the lineage and the decision.
SHARDS_TAG = "dataset.shards_prefix"
REVIEW_TAG = "review"
REVIEWER_TAG = "review.reviewer"
COMMENT_TAG = "review.comment"
REVIEW_RUN_TAG = "review.run_id"
GATE_TAG = "review.gate"  # "passed", or why the version failed the gate
GATE_PASSED = "passed"
GATE_FAILED = "gate_failed"  # the REVIEW_TAG of a version the gate stopped before any reviewer saw it
MAX_TAG_VALUE = 5000  # MLflow's model-version tag value limit


class ReviewError(EvaluationError):
    """A review cannot be done as asked (no such version, no test data, incompatible models);
    the test data and the scoring raise its base, ``EvaluationError``."""


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


def summary(result: Any, *, version: str, model_id: str | None) -> dict[str, Any]:
    """What the review keeps of one version's ``EvaluationResult`` (JSON-safe, for the XCom):
    its metrics and, when the evaluator made its per-class table (more than two classes), each
    class's recall."""
    per_class = result.artifacts.get("per_class_metrics")
    recall = {}
    if per_class is not None:
        recall = {class_key(row["positive_class"]): float(row["recall_score"])
                  for _, row in per_class.content.iterrows()}
    return {"version": version, "model_id": model_id, "run_id": result.run_id,
            "metrics": {k: float(v) for k, v in result.metrics.items()}, "per_class_recall": recall}


def evaluation_result(evaluation: Mapping[str, Any]) -> Any:
    """An ``EvaluationResult`` again from a ``summary`` (the metrics are all the gate reads)."""
    from mlflow.models import EvaluationResult

    return EvaluationResult(metrics=dict(evaluation["metrics"]), artifacts={}, run_id=evaluation["run_id"])


def comparison(challenger: Mapping[str, Any], champion: Mapping[str, Any] | None) -> dict[str, Any]:
    """Side by side (two ``summary``s): every evaluator metric and each class's recall of both,
    and the challenger's gain."""
    def rows(key: str, names: list[str]) -> list[dict[str, Any]]:
        out = []
        for name in names:
            a, b = challenger[key].get(name), (champion or {}).get(key, {}).get(name)
            out.append({"name": name, "challenger": a, "champion": b,
                        "delta": None if a is None or b is None else a - b})
        return out

    metrics = [m for m in challenger["metrics"] if m != "example_count"]
    return {"metrics": rows("metrics", metrics),
            "per_class": rows("per_class_recall", list(challenger["per_class_recall"])),
            "num_examples": int(challenger["metrics"].get("example_count", 0))}


def markdown(target: Target, comp: Mapping[str, Any]) -> str:
    """The comparison as the Markdown the reviewer reads in Airflow's approval form: scores (the
    ``*_score`` metrics, recalls) in percent, counts (a binary classifier's ``true_positives``
    ...) as numbers."""
    def row(label: str, r: Mapping[str, Any], score: bool) -> str:
        def fmt(v: float | None, sign: str = "") -> str:
            if v is None:
                return "–"
            if not score:
                return f"{v:{sign}g}"
            return f"{100 * v:{sign}.2f}" + (" pp" if sign else "%")

        return f"| {label} | {fmt(r['challenger'])} | {fmt(r['champion'])} | {fmt(r['delta'], '+')} |"

    champ = f"version {target.champion}" if target.champion else "none yet"
    lines = [f"**{target.name}**: challenger version {target.challenger} vs champion {champ}, "
             f"on {comp['num_examples']} held-out test rows (`{target.shards_prefix}`).", "",
             "| | challenger | champion | Δ |", "|---|---|---|---|"]
    lines += [row(r["name"], r, r["name"].endswith("_score")) for r in comp["metrics"]]
    lines += [row(f"recall, class {r['name']}", r, True) for r in comp["per_class"]]
    if not target.champion:
        lines += ["", "There is no champion yet: approving makes this version the first one."]
    return "\n".join(lines)


def side_by_side_metrics(comp: Mapping[str, Any]) -> dict[str, float]:
    """The review run's metrics: ``challenger.accuracy_score``, ``champion.…``, ``delta.…`` and
    ``<role>.class_<c>.recall``."""
    out = {}
    for group, fmt in (("metrics", "{role}.{name}"), ("per_class", "{role}.class_{name}.recall")):
        for row in comp[group]:
            for role in ("challenger", "champion", "delta"):
                if row[role] is not None:
                    out[fmt.format(role=role, name=row["name"])] = row[role]
    return out


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


def evaluate_version(name: str, version: str, dataset: Any, test: EvaluationData, *, role: str,
                     experiment_id: str) -> tuple[Any, str | None]:
    """Score a registered version (``evaluation.score_model``) in a run nested in the active
    review run: its ``EvaluationResult`` and the id of the LoggedModel it is linked to.

    Runs under ``runs.fluent_tracking_uri`` (evaluate logs through the fluent API).
    """
    import mlflow
    from mlflow import MlflowClient

    model_id = logged_model_id(MlflowClient().get_model_version(name, version))
    with mlflow.start_run(experiment_id=experiment_id, run_name=f"{role} (version {version})", nested=True,
                          tags={"model.name": name, "model.version": version, "review.role": role}) as run:
        result = score_model(f"models:/{name}/{version}", test, dataset, model_id=model_id,
                             what=f"{name} version {version}").result
    log.info("%s version %s (%s): %s (run %s)", name, version, role, result.metrics, run.info.run_id)
    return result, model_id


def _log_confusion_png(result: Any, role: str, tmp: str) -> None:
    """The evaluator's confusion matrix (drawn if matplotlib could) in the review run as well, as
    ``review/confusion_<role>.png``: both side by side where the comparison is."""
    artifact = result.artifacts.get("confusion_matrix")
    if artifact is not None:
        import mlflow

        path = os.path.join(tmp, f"confusion_{role}.png")
        artifact.content.save(path)  # a PIL image
        mlflow.log_artifact(path, "review")


def review(tracking_uri: str, target: Target, *, run_name: str, tags: Mapping[str, str] | None = None) -> dict:
    """Evaluate both versions on the challenger's test split in one review run (a nested run per
    version) and log the comparison to it; returns it with its Markdown and each ``summary``."""
    import mlflow

    with tempfile.TemporaryDirectory(prefix="mxpipe-review-") as tmp:
        test = load_test_split(target.shards_prefix, os.path.join(tmp, "data"))
        roles = {"challenger": target.challenger, **({"champion": target.champion} if target.champion else {})}
        with bounded_mlflow_env(), fluent_tracking_uri(tracking_uri):
            experiment_id = get_or_create_experiment(client(tracking_uri), REVIEW_EXPERIMENT)
            dataset = test.dataset()
            with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags={
                    **dict(tags or {}), "model.name": target.name, "model.challenger": target.challenger,
                    "model.champion": target.champion or ""}) as run:
                mlflow.log_params({"model.name": target.name, "challenger": target.challenger,
                                   "champion": target.champion or "none", "shards_prefix": target.shards_prefix})
                evaluations = {}
                for role, version in roles.items():
                    result, model_id = evaluate_version(target.name, version, dataset, test, role=role,
                                                        experiment_id=experiment_id)
                    evaluations[role] = summary(result, version=version, model_id=model_id)
                    _log_confusion_png(result, role, tmp)
                comp = comparison(evaluations["challenger"], evaluations.get("champion"))
                text = markdown(target, comp)
                mlflow.log_metrics(side_by_side_metrics(comp))
                mlflow.log_dict({"target": target.to_dict(), "comparison": comp, "evaluations": evaluations},
                                "review/comparison.json")
                mlflow.log_text(text + "\n", "review/comparison.md")
    log.info("review of %s version %s (run %s):\n%s", target.name, target.challenger, run.info.run_id, text)
    return {"target": target.to_dict(), "comparison": comp, "markdown": text, "review_run_id": run.info.run_id,
            "evaluations": evaluations, "task": test.task}


def gate(tracking_uri: str, target: Target, reviewed: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The automatic gate (``training.tracking.gate``) on a review's evaluations, recorded on the
    version and the review run alike: a failure tags them ``review=gate_failed`` with the
    reason in ``review.gate``; a pass sets ``review.gate=passed``. The version also gets
    ``review.run_id``, and its model card the gate's result (``review_card``): the outcome's
    ``card`` is the card's summary."""
    from training.tracking.gate import evaluate_gate, gate_for_task

    evaluations = reviewed["evaluations"]
    champion = evaluations.get("champion")
    spec = gate_for_task(spec, reviewed.get("task", "classification"))
    outcome = evaluate_gate(spec, evaluation_result(evaluations["challenger"]),
                            evaluation_result(champion) if champion else None)
    run_id = reviewed["review_run_id"]
    tags = {GATE_TAG: GATE_PASSED if outcome["passed"] else outcome["reason"][:MAX_TAG_VALUE]}
    if not outcome["passed"]:
        tags[REVIEW_TAG] = GATE_FAILED
    with bounded_mlflow_env():
        c = client(tracking_uri)
        for key, value in tags.items():
            c.set_tag(run_id, key, value)
        for key, value in {**tags, REVIEW_RUN_TAG: run_id}.items():
            c.set_model_version_tag(target.name, target.challenger, key, value)
        c.log_metric(run_id, "gate.passed", float(outcome["passed"]))
        c.log_text(run_id, outcome["markdown"] + "\n", "review/gate.md")
        card = review_card(c, target, evaluations, outcome, run_id)
    log.info("gate for %s version %s:\n%s", target.name, target.challenger, outcome["markdown"])
    return {**outcome, "card": card}


def review_card(c: Any, target: Target, evaluations: Mapping[str, Any], outcome: Mapping[str, Any],
                review_run_id: str) -> str:
    """The version's model card with the gate's result and both versions' figures on its test
    split, logged as ``model_card/reviewed.*`` to its training run (a copy to the review run);
    returns its summary for the approval body. A version without a card (registered before
    cards, or outside the training DAG) gets a line saying so: the review goes on."""
    from training.tracking import model_card

    source_run = c.get_model_version(target.name, target.challenger).run_id
    card = model_card.load_card(c, source_run) if source_run else None
    if card is None:
        return (f"**Model card**: none was logged for {target.name} version {target.challenger} (registered "
                "outside the training DAG or before model cards).")
    champion = evaluations.get("champion")
    card = model_card.reviewed(card, outcome, evaluations["challenger"]["metrics"],
                               target.champion, champion["metrics"] if champion else None, review_run_id)
    return model_card.log_card(c, card, source_run, model_card.REVIEWED, copy_to_run=review_run_id)["summary"]


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
