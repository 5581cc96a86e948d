"""Early stopping and the best epoch: the metric's direction, the decision, its state across a
resume, the config fields, retention of the best checkpoint and what MLflow is told."""
import math

import pytest

from common.config import ConfigError, OptimConfig, TrainConfig, recipe
from training.checkpoint.store import KEEP_STEP, CheckpointStore
from training.loop.early_stop import STOP_KEY_BASE, BestEpoch, agree_to_stop
from training.loop.metrics import higher_is_better
from training.loop.placement import KEY_STRIDE
from training.loop.resume import BEST_EPOCH, TrainState, resume_digest, train_record
from training.tracking.registry import selection_metrics, selection_tags

pytestmark = pytest.mark.unit


def _cfg(checkpoint=None, **optim):
    """The debug recipe watching val_accuracy (the records below vary it), unless told otherwise."""
    return recipe("debug").replace(optim={"early_stopping_metric": "val_accuracy", **optim},
                                   checkpoint=checkpoint or {})


def _records(values, metric="val_accuracy", steps_per_epoch=20):
    return [{"epoch": e, "global_step": (e + 1) * steps_per_epoch, "val_loss": 1.0, "val_accuracy": 0.5, metric: v}
            for e, v in enumerate(values)]


def _run(tracker, values, metric="val_accuracy", first_epoch=0):
    """Feed the epoch records from ``first_epoch`` on until the patience runs out; the epochs trained."""
    for record in _records(values, metric)[first_epoch:]:
        tracker.update(record)
        if tracker.patience_ran_out:
            tracker.stopped_at = record["epoch"]
            return record["epoch"] + 1
    return len(values) - first_epoch


# -- direction -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,higher", [("val_accuracy", True), ("accuracy", True), ("val_r2", True),
                                         ("val_loss", False), ("val_rmse", False), ("mae", False)])
def test_higher_is_better(name, higher):
    assert higher_is_better(name) is higher


def test_an_unknown_metric_has_no_direction_and_the_error_names_the_known_ones():
    with pytest.raises(ValueError, match=r"'val_f1'.*accuracy.*loss"):
        higher_is_better("val_f1")


# -- the decision ----------------------------------------------------------------------------------


def test_stops_after_patience_epochs_without_a_new_best_and_keeps_the_best_epoch():
    tracker = BestEpoch.from_config(_cfg(epochs=10, early_stopping_patience=2))
    trained = _run(tracker, [0.5, 0.8, 0.9, 0.88, 0.89, 0.95, 0.96])
    assert trained == 5 and tracker.stopped_at == 4
    assert (tracker.epoch, tracker.value, tracker.step, tracker.bad_epochs) == (2, 0.9, 60, 2)


def test_a_lower_is_better_metric_and_min_delta():
    tracker = BestEpoch.from_config(_cfg(early_stopping_patience=2, early_stopping_metric="val_loss",
                                         early_stopping_min_delta=0.05))
    # 0.97 and 0.93 improve on 1.0 by less than 0.05: no new best; 0.8 is one.
    assert [tracker.update(r) for r in _records([1.0, 0.97, 0.8, 0.78], "val_loss")] == [True, False, True, False]
    assert tracker.epoch == 2 and not tracker.patience_ran_out


def test_a_nan_metric_is_never_a_new_best():
    tracker = BestEpoch.from_config(_cfg(early_stopping_patience=1))
    assert not tracker.improves(math.nan)
    tracker.update(_records([0.5])[0])
    assert not tracker.update({"epoch": 1, "global_step": 40, "val_accuracy": math.nan})
    assert tracker.patience_ran_out and tracker.epoch == 0


def test_patience_zero_never_stops_but_still_knows_the_best():
    tracker = BestEpoch.from_config(_cfg(epochs=10, checkpoint={}))
    assert _run(tracker, [0.9, 0.1, 0.1, 0.1, 0.1]) == 5 and tracker.stopped_at is None and tracker.epoch == 0


def test_a_metric_the_task_does_not_report_is_refused_by_the_config_naming_the_choices():
    with pytest.raises(ConfigError, match=r"val_rmse.*not reported for model.task='classification'.*"
                                          r"\['auto', 'val_loss', 'val_accuracy'\]"):
        _cfg(early_stopping_patience=1, early_stopping_metric="val_rmse")


def test_a_metric_missing_from_the_epoch_record_is_bad_input_naming_what_it_reports():
    tracker = BestEpoch.from_config(_cfg(early_stopping_patience=1, early_stopping_metric="val_loss"))
    with pytest.raises(ValueError, match=r"val_loss.*\['val_accuracy'\]"):
        tracker.update({"epoch": 0, "global_step": 20, "val_accuracy": 0.5})


def test_auto_watches_the_validation_loss_or_for_regression_the_rmse():
    assert _cfg(early_stopping_patience=1, early_stopping_metric="auto").early_stopping_metric == "val_loss"
    regression = TrainConfig.from_dict({"data": {"label_column": "y"}, "model": {"task": "regression"},
                                        "optim": {"early_stopping_patience": 1}})
    assert regression.early_stopping_metric == "val_rmse"
    assert BestEpoch.from_config(regression).higher is False


def test_a_single_worker_decides_alone_without_the_kvstore():
    assert agree_to_stop(None, 3, True, 1) is True and agree_to_stop(None, 3, False, 1) is False


# -- across a resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("resume_after", [0, 2, 3, 4])
def test_a_tracker_restored_from_its_checkpoint_state_decides_as_an_uninterrupted_one(resume_after):
    cfg = _cfg(epochs=10, early_stopping_patience=2)
    values = [0.5, 0.8, 0.9, 0.88, 0.89, 0.95]
    whole = BestEpoch.from_config(cfg)
    _run(whole, values)
    first = BestEpoch.from_config(cfg)
    for record in _records(values)[:resume_after]:
        first.update(record)
    state = train_record(TrainState(epoch=resume_after, best=first), [], cfg, 2, {"shards": []})
    resumed = BestEpoch.restore(cfg, state[BEST_EPOCH], state["history"])
    _run(resumed, values, first_epoch=resume_after)
    assert resumed == whole


def test_a_checkpoint_without_tracker_state_is_replayed_from_its_history():
    cfg = _cfg(epochs=10, checkpoint={"export_epoch": "best"})
    history = _records([0.5, 0.9, 0.7])
    restored = BestEpoch.restore(cfg, None, history)
    assert (restored.epoch, restored.value, restored.step, restored.bad_epochs) == (1, 0.9, 40, 1)


def test_a_tracker_of_another_metric_is_replayed_from_the_history_in_the_configs_metric():
    # A checkpoint written when "auto" meant val_accuracy, resumed where it means val_loss.
    old = BestEpoch.from_config(_cfg(early_stopping_patience=2))
    history = [{"epoch": e, "global_step": (e + 1) * 20, "val_accuracy": a, "val_loss": loss}
               for e, (a, loss) in enumerate([(0.5, 0.9), (0.9, 0.4), (0.7, 0.3)])]
    for record in history:
        old.update(record)
    restored = BestEpoch.restore(_cfg(early_stopping_patience=2, early_stopping_metric="auto"), old.to_state(), history)
    assert (restored.metric, restored.epoch, restored.value, restored.bad_epochs) == ("val_loss", 2, 0.3, 0)


def test_the_checkpoint_names_the_best_step_for_retention_only_when_the_best_is_exported():
    for export, patience, keep in (("auto", 2, 60), ("best", 0, 60), ("last", 2, None), ("auto", 0, None)):
        cfg = _cfg(early_stopping_patience=patience, checkpoint={"export_epoch": export})
        best = BestEpoch.from_config(cfg)
        _run(best, [0.5, 0.8, 0.9, 0.7])
        record = train_record(TrainState(epoch=4, global_step=80, best=best), [], cfg, 2, {"shards": []})
        assert record.get(KEEP_STEP) == keep, export


# -- the config --------------------------------------------------------------------------------------


def test_the_debug_recipe_has_early_stopping_off_and_the_digests_of_before():
    cfg = recipe("debug")
    assert cfg.optim.early_stopping_patience == 0 and not cfg.exports_best
    raw = cfg.to_dict()
    assert raw["optim"]["early_stopping_metric"] == "auto" and raw["checkpoint"]["export_epoch"] == "auto"
    assert "early_stopping_patience" not in cfg.digest_dict()["optim"]
    on = cfg.replace(optim={"early_stopping_patience": 3})
    assert on.exports_best and on.digest() != cfg.digest() and resume_digest(on) != resume_digest(cfg)
    # What is exported changes nothing that is trained: a resume may change it.
    last = on.replace(checkpoint={"export_epoch": "last"})
    assert not last.exports_best and resume_digest(last) == resume_digest(on)


@pytest.mark.parametrize("optim,message", [
    ({"early_stopping_patience": -1}, "optim.early_stopping_patience must be >= 0"),
    ({"early_stopping_patience": 2.5}, "optim.early_stopping_patience must be an integer"),
    ({"early_stopping_metric": "accuracy"}, "optim.early_stopping_metric must be 'auto' or name a validation metric"),
    ({"early_stopping_min_delta": -0.1}, "optim.early_stopping_min_delta must be >= 0"),
])
def test_bad_early_stopping_fields_are_refused_by_name(optim, message):
    with pytest.raises(ConfigError, match=message):
        OptimConfig(**optim)


def test_the_form_schema_refuses_a_metric_that_is_not_a_validation_metric():
    import jsonschema

    schema = TrainConfig.model_json_schema()
    jsonschema.validate({"optim": {"early_stopping_metric": "val_loss"}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate({"optim": {"early_stopping_metric": "accuracy"}}, schema)


def test_bad_export_epoch_is_refused():
    with pytest.raises(ConfigError, match="checkpoint.export_epoch must be one of"):
        TrainConfig.from_dict({"checkpoint": {"export_epoch": "first"}})


def test_the_stop_decision_keys_clear_the_parameters_and_fit_ps_lite_server_choice():
    max_epochs = OptimConfig.model_fields["epochs"].metadata[-1].le
    assert STOP_KEY_BASE > 16 * KEY_STRIDE + KEY_STRIDE  # the highest stage's keys start at 15 strides
    assert (STOP_KEY_BASE + max_epochs) * 9973 < 2**31


# -- retention ---------------------------------------------------------------------------------------


def _save(store, step, keep_step=None):
    state = {"global_step": step} | ({KEEP_STEP: keep_step} if keep_step is not None else {})
    store.save(step, {"params.npz": f"params-{step}".encode()}, state)


def test_retention_keeps_the_best_checkpoint_until_another_is_the_best(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (20, 27, 34, 40, 47):
        _save(store, step, keep_step=20)
    assert store.committed_steps() == [47, 40, 20]
    _save(store, 60, keep_step=60)  # a new best: the former one ages out
    assert store.committed_steps() == [60, 47]


def test_the_best_checkpoint_is_kept_beside_the_permanent_ones(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2, keep_every_n_steps=100)
    for step in (30, 60, 90, 120, 150, 180):
        _save(store, step, keep_step=60)
    assert store.committed_steps() == [180, 150, 120, 60, 30]


# -- MLflow ------------------------------------------------------------------------------------------


def test_exporting_the_best_epoch_before_any_was_validated_is_a_config_error():
    """A configuration problem (no retry helps), not a crash of the export."""
    from training.loop.export import load_best

    cfg = _cfg(early_stopping_patience=3)
    with pytest.raises(ConfigError, match="no validated epoch to export"):
        load_best(None, None, TrainState(best=BestEpoch.from_config(cfg)), None)


def test_the_selection_is_recorded_as_tags_and_metrics():
    best = BestEpoch.from_config(_cfg(epochs=10, early_stopping_patience=2))
    _run(best, [0.5, 0.9, 0.8, 0.7])
    summary = best.summary("best")
    assert selection_tags(summary) == {"best.metric": "val_accuracy", "best.mode": "max", "best.epoch": "1",
                                       "best.value": "0.9", "best.step": "40", "model.epoch_exported": "best",
                                       "early_stopped_at": "3"}
    assert selection_metrics(summary) == {"best_epoch": 1.0, "best_val_accuracy": 0.9, "early_stopped_epoch": 3.0}
    assert selection_tags(None) == {} and selection_metrics(None) == {}
