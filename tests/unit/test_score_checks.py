"""The batch-scoring input's checks on real files: a schema mismatch and a drift each fail
naming the columns, a clean input passes; the parts the DAG maps over; the Parquet writer's
bytes depend on the rows only."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from data_checks.errors import DataValidationError
from data_checks.score_checks import ModelInput, check_drift, check_schema, profile
from data_checks.score_input import parts, plan_input, read_rows

pytestmark = pytest.mark.unit

INPUTS = [ModelInput("a", "numeric", 0.0, 1.0), ModelInput("b", "numeric", 5.0, 2.0),
          ModelInput("colour", "categorical", categories=("blue", "red")),
          ModelInput("size", "numeric", 10.0, 3.0, imputed=True)]


def _frame(n: int, seed: int, **shifts: float) -> pd.DataFrame:
    rng = np.random.RandomState(seed)
    return pd.DataFrame({"id": [f"r{seed}-{i}" for i in range(n)],
                         "a": rng.randn(n) + shifts.get("a", 0.0),
                         "b": rng.randn(n) * 2 * shifts.get("b_scale", 1.0) + 5,
                         "colour": rng.choice(["blue", "red"], n),
                         "size": rng.randn(n) * 3 + 10})


def _write(folder, frames: list[pd.DataFrame], fmt: str) -> str:
    folder.mkdir(exist_ok=True)
    for k, frame in enumerate(frames):
        if fmt == "parquet":
            frame.to_parquet(folder / f"part-{k}.parquet", index=False, row_group_size=100)
        else:
            frame.to_csv(folder / f"part-{k}.csv", index=False)
    return f"{folder}/part-*.{fmt}"


def _profile(spec: str, inputs: list[ModelInput] = INPUTS):
    plan = plan_input(spec)
    names = [m.name for m in inputs]
    text = [m.name for m in inputs if m.kind == "categorical"]
    return plan, profile(inputs, (f for p in parts(plan, 1000) for f in read_rows(plan, p, names, text, 64)))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_schema_mismatch_names_each_missing_and_non_numeric_column(tmp_path, fmt):
    good = _frame(50, 1)
    bad = _frame(50, 2).drop(columns=["b", "id"]).assign(a=lambda f: "x" + f["a"].round(2).astype(str))
    plan = plan_input(_write(tmp_path / "in", [good, bad], fmt))
    check_schema(INPUTS, plan_input(_write(tmp_path / "ok", [good], fmt)), "id")  # a matching input passes
    with pytest.raises(DataValidationError) as err:
        check_schema(INPUTS, plan, "id")
    message = str(err.value)
    assert "in columns ['b', 'id', 'a']" in message, message
    assert "column 'b' is missing (1 of 2 files" in message and "id column 'id' is missing" in message, message
    assert "column 'a' is not numbers" in message and "part-1." in message, message
    assert {(f["check"], f["column"]) for f in err.value.failures} == {
        ("column_present", "b"), ("column_present", "id"), ("column_is_numeric", "a")}


def test_drift_names_each_drifted_column_and_a_clean_input_passes(tmp_path):
    clean = _write(tmp_path / "clean", [_frame(400, 1), _frame(300, 2)], "parquet")
    _, prof = _profile(clean)
    summary = check_drift(INPUTS, prof, {}, clean)
    assert summary["passed"] and summary["train_statistics"] and prof.rows == 700

    drifted = _frame(400, 3, a=2.0, b_scale=3.0)
    drifted.loc[:99, "colour"] = "green"  # 25 % of the values: a category the train split never had
    drifted.loc[:9, "size"] = np.nan  # imputed by the model: not a problem
    spec = _write(tmp_path / "drifted", [drifted], "csv")
    _, prof = _profile(spec)
    with pytest.raises(DataValidationError) as err:
        check_drift(INPUTS, prof, {}, spec)
    message = str(err.value)
    assert "drifted from the model's training data in columns ['a', 'b', 'colour']" in message, message
    assert "a: mean 1.99" in message and "b: std 5.868" in message and "colour: 25.0% of values" in message, message
    assert "'green'" in message, message
    assert {c for f in err.value.failures for c in f["columns"]} == {"a", "b", "colour"}
    # A looser limit lets the same input through.
    assert check_drift(INPUTS, prof, {"max_mean_shift": 3, "max_std_ratio": 4, "max_unseen_share": 0.3}, spec)["passed"]


def test_missing_values_the_model_cannot_fill_are_named(tmp_path):
    frame = _frame(100, 4)
    frame.loc[:4, "a"] = np.nan
    spec = _write(tmp_path / "gaps", [frame], "parquet")
    _, prof = _profile(spec)
    with pytest.raises(DataValidationError, match=r"in columns \['a'\]: a: 5 missing and 0 non-finite values"):
        check_drift(INPUTS, prof, {}, spec)


def test_parquet_parts_are_runs_of_whole_row_groups_and_csv_files_whole(tmp_path):
    spec = _write(tmp_path / "p", [_frame(250, 1), _frame(50, 2)], "parquet")  # row groups 100, 100, 50 | 50
    plan = plan_input(spec)
    assert [(p["file"], p["row_groups"]) for p in parts(plan, 200)] == [(0, [0, 2]), (0, [2, 3]), (1, [0, 1])]
    assert [(p["file"], p["row_groups"]) for p in parts(plan, 10)] == [(0, [0, 1]), (0, [1, 2]), (0, [2, 3]),
                                                                      (1, [0, 1])]
    csv = plan_input(_write(tmp_path / "c", [_frame(250, 1), _frame(50, 2)], "csv"))
    assert [(p["file"], p["row_groups"]) for p in parts(csv, 10)] == [(0, None), (1, None)]
    rows = [len(f) for p in parts(plan, 200) for f in read_rows(plan, p, ["a"], [], 64)]
    assert sum(rows) == 300 and max(rows) <= 64


def test_a_file_changed_after_the_plan_is_refused(tmp_path):
    spec = _write(tmp_path / "p", [_frame(50, 1)], "csv")
    plan = plan_input(spec)
    _frame(50, 9).to_csv(tmp_path / "p" / "part-0.csv", index=False)
    with pytest.raises(ValueError, match="changed since it was checked"):
        list(read_rows(plan, parts(plan, 10)[0], ["a"], [], 64))


class _Model:
    """A stand-in pyfunc model: a label and a probability from the features."""

    def predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        return pd.DataFrame({"label": np.where(frame["a"] > 0, "pos", "neg"),
                             "probability": 1 / (1 + np.exp(-frame["a"].to_numpy()))}, index=frame.index)


def test_the_parquet_output_is_the_same_bytes_whenever_it_is_written(tmp_path):
    import pyarrow.parquet as pq

    from plugins.score_tasks import score_rows

    plan = plan_input(_write(tmp_path / "in", [_frame(300, 1)], "parquet"))
    target = {"inputs": [{"name": "a", "kind": "numeric"}], "key": "row", "chunk_rows": 128}
    part = {**parts(plan, 10_000)[0], "first_row": 1000}
    paths = [tmp_path / "one.parquet", tmp_path / "two.parquet"]
    for path in paths:
        assert score_rows(_Model(), plan, part, target, str(path)) == 300
        time.sleep(1.1)  # a timestamp anywhere in the file would now differ
    assert paths[0].read_bytes() == paths[1].read_bytes()
    meta = pq.ParquetFile(paths[0]).metadata
    assert meta.num_row_groups == 3 and set(meta.metadata) == {b"ARROW:schema"}  # no pandas metadata
    table = pq.read_table(paths[0])
    assert table.column_names == ["row", "label", "probability"]
    assert table.column("row").to_pylist() == list(range(1000, 1300))


def test_the_newest_asset_event_that_names_an_input_wins():
    from plugins.score_tasks import from_events

    def event(stamp: int, **extra: str) -> SimpleNamespace:
        return SimpleNamespace(timestamp=stamp, extra=extra)

    events = {"asset": [event(1, input_uri="s3://b/old/"), event(3, other="x"), event(2, input_uri="s3://b/new/",
                                                                                      version="4")]}
    assert from_events(events) == {"input_uri": "s3://b/new/", "version": "4"}
    assert from_events(None) == {} and json.dumps(from_events({"a": [event(1, other="x")]})) == "{}"
