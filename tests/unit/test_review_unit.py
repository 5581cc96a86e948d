"""The Airflow-free side of a model review: the comparison and the automatic gate on real
``EvaluationResult``s (``mlflow.models.evaluate`` on a few fixed predictions, logged to a SQLite
store in a temporary folder), and the reading of Airflow's decision XCom."""
import json
from types import SimpleNamespace

import pytest

from training.tracking.gate import DEFAULT_GATE, PARAM_SCHEMA, GateConfigError, evaluate_gate, parse
from training.tracking.review import Target, comparison, evaluation_result, markdown, side_by_side_metrics, summary

pytestmark = pytest.mark.unit

CLASSES = ["ant", "bee", "cow"]
ROWS = 200
# Wrong predictions per model, all on class "ant": accuracy 1 - errors / ROWS.
ERRORS = {"champion": 20, "slightly_worse": 22, "worse": 30, "better": 10, "broken": 130}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One real EvaluationResult per entry of ERRORS (the default classifier evaluator)."""
    import mlflow
    import numpy as np
    import pandas as pd
    from mlflow import MlflowClient

    from training.tracking.runs import fluent_tracking_uri

    tmp = tmp_path_factory.mktemp("evaluate")
    truth = np.asarray(CLASSES * (ROWS // len(CLASSES) + 1))[:ROWS]
    out = {}
    with fluent_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}"):
        experiment = MlflowClient().create_experiment("review-unit", artifact_location=(tmp / "artifacts").as_uri())
        for name, errors in ERRORS.items():
            predicted = truth.copy()
            wrong = np.flatnonzero(truth != "ant")[:errors]
            predicted[wrong] = "ant"
            frame = pd.DataFrame({"f0": np.arange(ROWS, dtype=float), "target": truth, "prediction": predicted})
            with mlflow.start_run(experiment_id=experiment, run_name=name):
                out[name] = mlflow.models.evaluate(
                    data=frame, targets="target", predictions="prediction", model_type="classifier",
                    evaluators="default", evaluator_config={"label_list": CLASSES, "log_model_explainability": False})
    return out


def _rows(outcome):
    return [(r["check"], r["result"]) for r in outcome["rows"]]


def test_the_evaluator_reports_accuracy_and_a_per_class_table(results):
    assert results["champion"].metrics["accuracy_score"] == pytest.approx(0.9)
    assert results["slightly_worse"].metrics["accuracy_score"] == pytest.approx(0.89)
    s = summary(results["champion"], version="1", model_id=None)
    # Every error is a bee or a cow predicted as an ant: their recall drops, ant's stays 1.
    assert s["per_class_recall"]["ant"] == 1.0 and s["per_class_recall"]["bee"] < 1.0
    json.dumps(s)  # what compare returns is an XCom


def test_comparison_side_by_side_and_its_metrics(results):
    chall = summary(results["better"], version="2", model_id=None)
    champ = summary(results["champion"], version="1", model_id=None)
    comp = comparison(chall, champ)
    acc = next(r for r in comp["metrics"] if r["name"] == "accuracy_score")
    assert acc["challenger"] == pytest.approx(0.95) and acc["delta"] == pytest.approx(0.05)
    assert comp["num_examples"] == ROWS and {r["name"] for r in comp["per_class"]} == set(CLASSES)
    text = markdown(Target("m", "2", "1", "s3://b/shards"), comp)
    assert "challenger version 2 vs champion version 1" in text
    assert "| accuracy_score | 95.00% | 90.00% | +5.00 pp |" in text and "| recall, class ant |" in text
    metrics = side_by_side_metrics(comp)
    assert metrics["delta.accuracy_score"] == pytest.approx(0.05) and "champion.class_cow.recall" in metrics
    alone = markdown(Target("m", "2", None, "s3://b/shards"), comparison(chall, None))
    assert "champion none yet" in alone and "first one" in alone and "| accuracy_score | 95.00% | – | – |" in alone


def test_default_gate_without_champion_applies_only_the_floor(results):
    outcome = evaluate_gate(DEFAULT_GATE, results["worse"], None)
    assert outcome["passed"] and outcome["reason"] == ""
    assert _rows(outcome) == [("threshold", "pass"), ("max_absolute_drop", "skipped (no champion)")]
    broken = evaluate_gate(DEFAULT_GATE, results["broken"], None)
    assert not broken["passed"] and broken["reason"] == "accuracy_score 0.3500 is not >= 0.5"


def test_default_gate_tolerates_a_point_of_accuracy_and_no_more(results):
    # Exactly the tolerated point below the champion passes (the bound is inclusive).
    within = evaluate_gate(DEFAULT_GATE, results["slightly_worse"], results["champion"])
    assert within["passed"], within["markdown"]
    worse = evaluate_gate(DEFAULT_GATE, results["worse"], results["champion"])
    assert not worse["passed"]
    assert _rows(worse) == [("threshold", "pass"), ("max_absolute_drop", "fail")]
    assert worse["reason"] == "accuracy_score 0.8500 is not >= champion - 0.01 (0.8900)"
    assert "| accuracy_score | 0.8500 | 0.9000 | >= champion - 0.01 (0.8900) | fail |" in worse["markdown"]
    assert worse["markdown"].startswith("**Gate: failed**")


def test_required_gains_use_mlflows_baseline_comparison(results):
    better, champion = results["better"], results["champion"]  # 0.95 vs 0.90
    assert evaluate_gate({"accuracy_score": {"greater_is_better": True, "min_absolute_change": 0.04}},
                         better, champion)["passed"]
    assert not evaluate_gate({"accuracy_score": {"greater_is_better": True, "min_absolute_change": 0.06}},
                             better, champion)["passed"]
    assert evaluate_gate({"accuracy_score": {"greater_is_better": True, "min_relative_change": 0.05}},
                         better, champion)["passed"]  # 0.95 >= 0.90 * 1.05 = 0.945
    assert not evaluate_gate({"accuracy_score": {"greater_is_better": True, "max_relative_drop": 0.01}},
                             results["worse"], champion)["passed"]  # 0.85 < 0.90 * 0.99


def test_lower_is_better_flips_every_check(results):
    spec = {"accuracy_score": {"greater_is_better": False, "threshold": 0.9, "max_absolute_drop": 0.01}}
    assert evaluate_gate(spec, results["slightly_worse"], results["champion"])["passed"]
    failed = evaluate_gate(spec, results["better"], results["champion"])
    assert _rows(failed) == [("threshold", "fail"), ("max_absolute_drop", "fail")]
    assert "is not <= champion + 0.01 (0.9100)" in failed["reason"]


def test_gate_on_results_rebuilt_from_the_xcom_is_the_same(results):
    rebuilt = {k: evaluation_result(json.loads(json.dumps(summary(results[k], version="1", model_id=None))))
               for k in ("worse", "champion")}
    assert evaluate_gate(DEFAULT_GATE, rebuilt["worse"], rebuilt["champion"]) == \
        evaluate_gate(DEFAULT_GATE, results["worse"], results["champion"])


@pytest.mark.parametrize("spec,message", [
    ({}, "must map metric names"),
    ({"accuracy_score": 0.9}, "expected an object"),
    ({"accuracy_score": {"threshold": 0.9}}, "greater_is_better must be true or false"),
    ({"accuracy_score": {"greater_is_better": True}}, "no check given"),
    ({"accuracy_score": {"greater_is_better": True, "floor": 0.9}}, r"unknown keys \['floor'\]"),
    ({"accuracy_score": {"greater_is_better": True, "min_absolute_change": -0.01}}, "must be > 0"),
    ({"accuracy_score": {"greater_is_better": True, "max_relative_drop": 2}}, r"fraction in \[0, 1\]"),
    ({"accuracy_score": {"greater_is_better": True, "threshold": "high"}}, "finite number"),
])
def test_bad_gate_configurations_are_refused_by_name(spec, message):
    import jsonschema

    with pytest.raises(GateConfigError, match=message):
        parse(spec)
    with pytest.raises(jsonschema.ValidationError):  # and by the DAG's Param, at trigger time
        jsonschema.validate(spec, PARAM_SCHEMA)


def test_default_gate_fits_its_schema_and_unknown_metrics_are_named(results):
    import jsonschema

    jsonschema.validate(DEFAULT_GATE, PARAM_SCHEMA)
    with pytest.raises(GateConfigError, match=r"\['log_loss'\] are not among the evaluation's metrics"):
        evaluate_gate({"log_loss": {"greater_is_better": False, "threshold": 1.0}}, results["champion"], None)


def test_decision_and_event_reading():
    from plugins.review_tasks import _decision, _from_events, model_asset

    approval = {"chosen_options": ["Reject"], "params_input": {"comment": "worse on class 3"},
                "responded_by_user": {"id": "admin", "name": "admin"}}
    assert _decision(approval) == ("Reject", "admin", "worse on class 3")
    assert _decision({"chosen_options": ["Approve"], "params_input": {}, "responded_by_user": None}) == \
        ("Approve", "unknown", "")
    with pytest.raises(RuntimeError):
        _decision(None)
    asset = model_asset("digits")
    older = SimpleNamespace(extra={"registered_model_name": "digits", "version": 3}, timestamp=1)
    newer = SimpleNamespace(extra={"registered_model_name": "digits", "version": 4}, timestamp=2)
    assert _from_events({asset: [older, newer]}) == ("digits", "4")
    assert _from_events({asset: [SimpleNamespace(extra={}, timestamp=1)]}) == ("digits", None)
    assert _from_events({}) == (None, None)
