"""Per-step metrics: the worker's recorder (cadence, cap, resume) and how registry logs them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from training.tracking import registry
from common.config import ConfigError, recipe
from training.loop.metrics import StepRecorder
from training.tracking.mlflow_params import MAX_METRICS_PER_BATCH, step_metric_points

pytestmark = pytest.mark.unit


def _run(rec: StepRecorder, start: int, stop: int) -> StepRecorder:
    for g in range(start + 1, stop + 1):
        if rec.due(g):
            rec.record(g, 1.0 / g, 0.01)
    return rec


def test_every_n_th_step_is_recorded():
    rec = _run(StepRecorder(every_n=3, cap=100), 0, 20)
    assert [r["step"] for r in rec.records] == [3, 6, 9, 12, 15, 18]
    assert rec.records[0] == {"step": 3, "train_loss": pytest.approx(1 / 3), "learning_rate": 0.01}


def test_over_the_cap_the_stride_doubles_and_every_other_record_goes():
    rec = _run(StepRecorder(every_n=1, cap=10), 0, 1_000_000)
    steps = [r["step"] for r in rec.records]
    assert 5 <= len(steps) <= 10  # bounded whatever the run length
    assert rec.stride == 2 ** 17 and steps == [rec.stride * i for i in range(1, len(steps) + 1)]


@pytest.mark.parametrize("resume_at", [0, 7, 10, 11, 64, 333, 999])
def test_a_resumed_recorder_ends_with_the_uninterrupted_records(resume_at):
    reference = _run(StepRecorder(every_n=2, cap=8), 0, 1000).records
    before = _run(StepRecorder(every_n=2, cap=8), 0, resume_at)
    # The killed attempt went on past its checkpoint: those records are not in the checkpoint.
    saved = [dict(r) for r in before.records]
    _run(before, resume_at, resume_at + 37)
    resumed = _run(StepRecorder(2, 8, saved, resume_at), resume_at, 1000)
    assert resumed.records == reference


def test_records_past_the_checkpoint_step_are_dropped_on_resume():
    rec = StepRecorder(1, 100, [{"step": s, "train_loss": 1.0, "learning_rate": 0.1} for s in (1, 2, 3, 4)], 2)
    assert [r["step"] for r in rec.records] == [1, 2]


def test_config_bounds():
    cfg = recipe("debug")
    assert cfg.checkpoint.step_metrics_every_n == 1 and cfg.checkpoint.max_step_metrics == 2000
    with pytest.raises(ConfigError, match="checkpoint.step_metrics_every_n"):
        cfg.replace(checkpoint={"step_metrics_every_n": 0})
    with pytest.raises(ConfigError, match="checkpoint.max_step_metrics"):
        cfg.replace(checkpoint={"max_step_metrics": 10**6})


def test_step_metric_changes_do_not_change_the_resume_digest():
    from training.loop.worker import resume_digest

    cfg = recipe("debug")
    assert resume_digest(cfg) == resume_digest(cfg.replace(checkpoint={"step_metrics_every_n": 5}))


def test_step_points_are_suffixed_and_at_the_global_step():
    points = step_metric_points([{"step": 5, "train_loss": 0.5, "learning_rate": 0.1},
                                 {"step": 10, "train_loss": 0.25, "learning_rate": 0.1}])
    assert sorted(points) == [("learning_rate_step", 0.1, 5), ("learning_rate_step", 0.1, 10),
                              ("train_loss_step", 0.25, 10), ("train_loss_step", 0.5, 5)]
    with pytest.raises(ValueError, match="invalid MLflow metric names"):
        step_metric_points([{"step": 1, "bad!": 1.0}])


def test_many_step_points_go_in_batches_within_the_limit_and_a_retry_skips_them():
    records = [{"step": s, "train_loss": 1.0, "learning_rate": 0.1} for s in range(1, 2001)]
    points = step_metric_points(records)
    calls = []
    logged = {}

    def log_batch(run_id, metrics, synchronous):
        calls.append(len(metrics))
        for m in metrics:
            logged.setdefault(m.key, []).append(SimpleNamespace(step=m.step))

    client = SimpleNamespace(log_batch=log_batch, get_metric_history=lambda run_id, key: logged[key])
    run = SimpleNamespace(info=SimpleNamespace(run_id="r"), data=SimpleNamespace(metrics={}))
    assert registry._log_metrics(client, run, points) == 4000
    assert calls == [MAX_METRICS_PER_BATCH] * 4
    run.data.metrics = dict.fromkeys(logged, 1.0)  # the retry of the same run
    assert registry._log_metrics(client, run, points) == 0 and len(calls) == 4
