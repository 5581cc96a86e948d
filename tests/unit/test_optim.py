"""The optimizer and schedule a worker builds: the rate is a function of the global step."""
import pytest

from common.config import ConfigError, recipe
from training.loop.optim import learning_rate_at, lr_scheduler, optimizer_params

pytestmark = pytest.mark.unit

STEPS_PER_EPOCH = 10  # 3 epochs of the debug recipe: 30 optimizer steps


def _cfg(**optim):
    return recipe("debug").replace(optim={"learning_rate": 0.1, **optim})


SCHEDULES = [
    {"lr_schedule": "constant", "warmup_steps": 5},
    {"lr_schedule": "step", "lr_decay_epochs": (1, 2), "lr_decay_factor": 0.5, "warmup_steps": 3},
    {"lr_schedule": "cosine", "warmup_steps": 4, "final_lr": 0.001},
    {"lr_schedule": "poly", "warmup_steps": 4, "poly_power": 2.0},
]


@pytest.mark.parametrize("optim", SCHEDULES, ids=[s["lr_schedule"] for s in SCHEDULES])
def test_a_fresh_scheduler_at_step_g_gives_the_rate_of_one_that_counted_to_g(optim):
    cfg = _cfg(**optim)
    counted = lr_scheduler(cfg, 2, STEPS_PER_EPOCH)
    rates = [counted(n) for n in range(1, 31)]
    for g in (1, 7, 10, 11, 19, 21, 30):
        assert lr_scheduler(cfg, 2, STEPS_PER_EPOCH)(g) == pytest.approx(rates[g - 1], rel=1e-12), g
    # Warmup rises linearly from 0 to the peak; the schedule then moves away from the peak.
    warm = optim["warmup_steps"]
    assert rates[0] == pytest.approx(0.1 * 1 / warm)
    assert max(rates) == pytest.approx(0.1)
    if optim["lr_schedule"] != "constant":
        assert rates[-1] < 0.1 * 0.6


def test_step_schedule_drops_at_the_decay_epochs():
    sched = lr_scheduler(_cfg(**SCHEDULES[1]), 2, STEPS_PER_EPOCH)
    assert [round(sched(n), 6) for n in (9, 10, 11, 20, 21, 30)] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]


def test_optimizer_starts_at_the_global_step_and_scales_the_rate():
    from common.mx import import_mxnet

    mx = import_mxnet()
    cfg = _cfg(lr_schedule="cosine", lr_scaling="linear", base_batch=32, optimizer="lamb", weight_decay=1e-4)
    params = optimizer_params(cfg, 2, STEPS_PER_EPOCH, global_step=12)
    assert params["learning_rate"] == pytest.approx(0.1 * 64 / 32) and params["wd"] == 1e-4
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = mx.gluon.Trainer(net.collect_params(), cfg.optim.optimizer, params)
    assert trainer._optimizer.num_update == 12
    assert learning_rate_at(trainer) == pytest.approx(lr_scheduler(cfg, 2, STEPS_PER_EPOCH)(12))


def test_warmup_longer_than_the_job_is_refused_when_the_steps_are_known():
    with pytest.raises(ConfigError, match="warmup_steps=40 must be below the 30 optimizer steps"):
        lr_scheduler(_cfg(warmup_steps=40), 2, STEPS_PER_EPOCH)
    with pytest.raises(ConfigError, match="inside the warmup"):
        lr_scheduler(_cfg(lr_schedule="step", lr_decay_epochs=(1,), warmup_steps=10), 2, STEPS_PER_EPOCH)
