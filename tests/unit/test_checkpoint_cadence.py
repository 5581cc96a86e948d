"""checkpoint.every_n_steps = "auto": the Young/Daly interval, its inputs, re-planning on drift."""
import math
import time

import pytest

from common.config import CheckpointConfig, ConfigError
from tests.unit.checkpoint_support import snapshot_at
from training.checkpoint import cadence
from training.checkpoint.cadence import AutoCadence, CadencePlan, interval_s
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.unit


def test_daly_interval_is_youngs_for_a_cheap_checkpoint_and_the_mtbf_for_a_dear_one():
    young = math.sqrt(2 * 2.0 * 3600)
    assert interval_s(2.0, 3600) == pytest.approx(young, rel=0.02)
    assert interval_s(2.0, 3600) == pytest.approx(young * (1 + math.sqrt(2 / 7200) / 3 + 2 / 64800) - 2)
    assert interval_s(0.5, 86400) == pytest.approx(math.sqrt(2 * 0.5 * 86400), rel=0.01)
    assert interval_s(100, 40) == 40  # C >= 2M: checkpoint once per expected failure
    for cost, mtbf in ((0, 10), (1, 0), (-1, 10)):
        with pytest.raises(ValueError, match="must be > 0"):
            interval_s(cost, mtbf)


def test_plan_in_steps_with_one_upload_in_flight_as_the_floor():
    plan = CadencePlan.make(blocked_s=0.1, upload_s=0.9, step_s=0.05, mtbf_s=600)
    assert plan.cost_s == pytest.approx(1.0)
    assert plan.every_n_steps == math.ceil(interval_s(1.0, 600) / 0.05)
    # A failure every 2 s: Daly says 2 s of training, but the upload takes 3 s; shorter would only skip.
    slow = CadencePlan.make(blocked_s=0.01, upload_s=3.0, step_s=0.1, mtbf_s=2)
    assert slow.interval_s == 3.0 and slow.every_n_steps == 30
    assert CadencePlan.make(blocked_s=0.01, upload_s=0.01, step_s=10.0, mtbf_s=1).every_n_steps == 1


def test_auto_starts_at_the_bootstrap_plans_once_measured_and_replans_only_on_drift(caplog):
    caplog.set_level("INFO", logger="training.checkpoint.cadence")
    auto = AutoCadence(mtbf_s=3600)
    assert auto.every_n_steps == cadence.BOOTSTRAP_STEPS and auto.plan is None
    assert auto.measured(blocked_s=0.05, upload_s=None, step_s=None) is None  # first save: nothing to go by
    assert auto.measured(blocked_s=0.05, upload_s=0.45, step_s=None) is None  # no step time yet
    plan = auto.measured(blocked_s=0.05, upload_s=0.45, step_s=0.02)
    assert plan is not None and auto.every_n_steps == plan.every_n_steps > cadence.BOOTSTRAP_STEPS
    assert plan.every_n_steps == math.ceil(interval_s(0.5, 3600) / 0.02)
    assert "checkpoint cadence (auto): every" in caplog.text and "MTBF 3600s" in caplog.text
    assert "upload 0.450s" in caplog.text and "step time 20.0ms" in caplog.text
    # 10 % dearer: within the drift threshold, no new plan.
    assert auto.measured(blocked_s=0.055, upload_s=0.5, step_s=None) is None and auto.replans == 0
    # The store got 4x slower: the smoothed cost drifts past 25 % within a few checkpoints.
    for _ in range(5):
        if auto.measured(blocked_s=0.2, upload_s=1.8, step_s=None) is not None:
            break
    assert auto.replans == 1 and auto.plan.cost_s > 1.25 * plan.cost_s
    assert auto.every_n_steps > plan.every_n_steps
    assert "re-planned (drift > 25%)" in caplog.text
    # Steps slower (same cost): fewer steps for the same interval.
    before = auto.plan
    for _ in range(5):
        if auto.measured(before.blocked_s, before.upload_s, step_s=0.04) is not None:
            break
    assert auto.replans == 2 and auto.every_n_steps < before.every_n_steps


def test_config_takes_auto_or_an_integer_and_nothing_else():
    assert CheckpointConfig(every_n_steps="auto", mtbf_s=1800).every_n_steps == "auto"
    assert CheckpointConfig(every_n_steps=7).every_n_steps == 7
    for bad, said in (("7", "an integer or 'auto', got '7'"), (0, ">= 1 or 'auto', got 0"),
                      ("AUTO", "an integer or 'auto'"), (2.5, "an integer or 'auto'")):
        with pytest.raises(ConfigError, match=f"checkpoint.every_n_steps must be {said}"):
            CheckpointConfig(every_n_steps=bad)
    with pytest.raises(ConfigError, match="checkpoint.mtbf_s must be > 0"):
        CheckpointConfig(mtbf_s=0)


def test_manager_with_auto_plans_on_rank_0_and_other_ranks_keep_the_bootstrap(tmp_path):
    """Steps of 10 ms (a fake clock for the steps, real saves): the plan's step time is the time
    between two periodic saves over the steps between them."""
    cfg = CheckpointConfig(every_n_steps="auto", mtbf_s=60, async_upload=False)
    managers = {rank: CheckpointManager(CheckpointStore(str(tmp_path / str(rank))), cfg, 10_000, snapshot_at,
                                        rank=rank) for rank in (0, 1)}
    saved = {0: [], 1: []}
    for rank, m in managers.items():
        for step in range(1, 200):
            time.sleep(0.01)
            if m.due(step, step, now=time.monotonic()) and m.save(step, must=False):
                saved[rank].append(step)
            if step == 40 and rank == 1:
                break
    rank0 = managers[0]
    assert saved[1] == [] and managers[1]._every_n_steps == cadence.BOOTSTRAP_STEPS
    assert saved[0][:2] == [10, 20]  # bootstrap; the second save has the first's upload and a step time
    plan = rank0._auto.plan
    assert plan is not None and rank0._every_n_steps == plan.every_n_steps
    assert 0.01 <= plan.step_s < 0.03  # the sleep, plus the loop's own time on a loaded machine
    stats = rank0.finish(saved[0][-1])
    assert stats["auto_every_n_steps"] == rank0._every_n_steps and stats["auto_replans"] >= 0
