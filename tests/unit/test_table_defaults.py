"""The defaults a table trains with: an epoch budget that early stopping ends (the best epoch
exported), a cosine learning rate over the budget, dropout 0.1; an explicit setting wins; the
``debug`` recipe and the digests of configs written before keep what they were."""
import pytest

from common.config import DEFAULT_EPOCHS, DEFAULT_PATIENCE, TrainConfig, recipe
from training.loop.resume import resume_digest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_table_gets_an_epoch_budget_with_early_stopping_and_the_best_epoch(task):
    for cfg in (TrainConfig.from_dict({"model": {"task": task}}),
                recipe("digits").replace(model={"task": task})):  # the DAG's starting point
        assert (cfg.optim.epochs, cfg.optim.early_stopping_patience) == (DEFAULT_EPOCHS, DEFAULT_PATIENCE) == (100, 10)
        assert cfg.exports_best and cfg.optim.lr_schedule == "cosine" and cfg.model.dropout == 0.1
        assert cfg.early_stopping_metric == ("val_rmse" if task == "regression" else "val_loss")


def test_an_explicit_setting_wins():
    cfg = recipe("digits").replace(optim={"epochs": 20, "early_stopping_patience": 0, "lr_schedule": "constant"},
                                   model={"dropout": 0.0})
    assert cfg.optim.epochs == 20 and not cfg.exports_best and cfg.optim.lr_schedule == "constant"
    assert recipe("digits").replace(optim={"epochs": 30}).optim.early_stopping_patience == DEFAULT_PATIENCE
    assert not recipe("digits").replace(checkpoint={"export_epoch": "last"}).exports_best


def test_patience_zero_keeps_the_digest_it_had_and_the_new_default_changes_it():
    """Checkpoints written while patience 0 was the default embed digests without the field."""
    off = TrainConfig.from_dict({"optim": {"early_stopping_patience": 0}})
    assert "early_stopping_patience" not in off.digest_dict()["optim"]
    on = TrainConfig()
    assert on.digest_dict()["optim"]["early_stopping_patience"] == DEFAULT_PATIENCE
    assert resume_digest(on) != resume_digest(off)


def test_the_debug_recipe_still_runs_every_epoch_at_a_constant_rate():
    cfg = recipe("debug")
    assert (cfg.optim.epochs, cfg.optim.early_stopping_patience, cfg.optim.lr_schedule, cfg.model.dropout) == \
        (3, 0, "constant", 0.0)
