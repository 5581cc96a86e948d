"""The Airflow-free arithmetic of a model review and the reading of Airflow's decision XCom."""
from types import SimpleNamespace

import pytest

from training.tracking.review import ReviewError, Target, comparison, confusion, markdown, scores

pytestmark = pytest.mark.unit


def test_confusion_counts_rows_as_truth_and_matches_mixed_types():
    # 3.0 and "3" are the same class as 3: values come back from CSV/JSON/pandas differently.
    m = confusion([3, 3, 5, 5, 5], [3.0, "5", 5, 5, "3"], [3, 5])
    assert m == [[1, 1], [1, 2]]


def test_confusion_refuses_unknown_predictions_and_length_mismatch():
    with pytest.raises(ReviewError, match="7"):
        confusion([1, 2], [1, 7], [1, 2])
    with pytest.raises(ValueError, match="2 labels but 1"):
        confusion([1, 2], [1], [1, 2])


def test_scores_per_class_accuracy_and_empty_class():
    s = scores([[3, 1, 0], [0, 2, 0], [0, 0, 0]], ["a", "b", "c"])
    assert s["accuracy"] == pytest.approx(5 / 6)
    assert s["per_class_accuracy"] == {"a": 0.75, "b": 1.0, "c": None}
    assert s["num_examples"] == 6


def test_comparison_side_by_side_with_and_without_champion():
    chall = scores([[3, 1], [0, 4]], [0, 1])
    champ = scores([[2, 2], [0, 4]], [0, 1])
    comp = comparison(chall, champ)
    assert comp["accuracy"] == {"challenger": 0.875, "champion": 0.75, "delta": pytest.approx(0.125)}
    assert comp["per_class"][0] == {"class": "0", "challenger": 0.75, "champion": 0.5, "delta": 0.25}
    alone = comparison(chall, None)
    assert alone["accuracy"]["champion"] is None and alone["accuracy"]["delta"] is None
    text = markdown(Target("m", "2", None, "s3://b/shards"), alone)
    assert "champion none yet" in text and "first one" in text and "87.50%" in text


def test_markdown_shows_both_versions_and_the_gain():
    comp = comparison(scores([[3, 1], [0, 4]], [0, 1]), scores([[2, 2], [0, 4]], [0, 1]))
    text = markdown(Target("m", "2", "1", "s3://b/shards"), comp)
    assert "challenger version 2 vs champion version 1" in text
    assert "| accuracy | 87.50% | 75.00% | +12.50 pp |" in text
    assert "| class 0 | 75.00% | 50.00% | +25.00 pp |" in text


def test_decision_and_event_reading():
    from plugins.review import _decision, _from_events, model_asset

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
