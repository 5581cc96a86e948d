"""A sweep's trials (grid and random), the refusals that name the field, the ASHA rule and a
trial's pruner against its rungs in storage (a local folder), and the selection of the best
trial and the pruning's savings."""
import dataclasses
import json
import math

import pytest

from common.config import ConfigError, TrainConfig, recipe
from common.sweep import combinations, keeps_training, plan, rung_epochs, rung_of, trial_value
from training.loop.pruning import Pruner

pytestmark = pytest.mark.unit


def _with(sweep: dict) -> TrainConfig:
    return recipe("debug").replace(sweep=sweep)


def test_a_grid_is_every_combination_first_field_slowest_each_config_whole():
    trials = plan(_with({"space": {"optim.learning_rate": [0.01, 0.001], "model.dropout": [0.0, 0.2, 0.4]}}))
    assert [t.values for t in trials] == [
        {"optim.learning_rate": lr, "model.dropout": d} for lr in (0.01, 0.001) for d in (0.0, 0.2, 0.4)]
    assert all(t.config.sweep is None for t in trials)  # a trial is a plain training config
    assert trials[4].config.optim.learning_rate == 0.001 and trials[4].config.model.dropout == 0.2
    assert trials[4].config.optim.epochs == recipe("debug").optim.epochs  # the rest is the base's
    assert len({t.config.digest() for t in trials}) == 6
    assert trials[1].label == "trial 1: optim.learning_rate=0.01, model.dropout=0.2"


def test_random_draws_are_seeded_in_range_log_uniform_and_whole_for_an_integer_field():
    sweep = {"method": "random", "trials": 40, "seed": 7,
             "space": {"optim.learning_rate": {"low": 1e-4, "high": 1e-1, "log": True},
                       "optim.batch_size": {"low": 16, "high": 64}, "model.dropout": [0.0, 0.5]}}
    first, again = combinations(_with(sweep).sweep), combinations(_with(sweep).sweep)
    assert first == again and len(first) == 40
    assert first != combinations(_with({**sweep, "seed": 8}).sweep)
    lrs = [v["optim.learning_rate"] for v in first]
    assert all(1e-4 <= lr <= 1e-1 for lr in lrs)
    assert sum(lr < 1e-2 for lr in lrs) > 20  # log-uniform: two of three decades lie below 0.01
    assert all(type(v["optim.batch_size"]) is int and 16 <= v["optim.batch_size"] <= 64 for v in first)
    assert {v["model.dropout"] for v in first} == {0.0, 0.5}
    plan(_with(sweep))  # every draw makes a valid config


@pytest.mark.parametrize("sweep, message", [
    ({"space": {"optim.lr": [0.1]}}, "sweep.space['optim.lr']: unknown config field 'lr' of section 'optim'"),
    ({"space": {"nosuch.field": [1]}}, "sweep.space['nosuch.field']: unknown config field"),
    ({"space": {"learning_rate": [1]}}, "sweep.space['learning_rate']: unknown config field"),
    ({"space": {"optim.epochs": ["3"]}}, "optim.epochs must be an integer, got '3' (a string)"),
    ({"space": {"optim.learning_rate": [0.1, 50]}}, "sweep trial 1 (optim.learning_rate=50): optim.learning_rate"),
    ({"space": {"optim.epochs": []}}, "sweep.space['optim.epochs']: an empty list of values"),
    ({"method": "random", "space": {"optim.learning_rate": {"low": 0.1, "high": 0.1}}},
     "sweep.space['optim.learning_rate']: an empty range: low=0.1 must be below high=0.1"),
    ({"method": "random", "space": {"optim.learning_rate": {"low": 0, "high": 0.1, "log": True}}},
     "a log range needs low > 0"),
    ({"space": {"optim.learning_rate": {"low": 0.01, "high": 0.1}}}, "needs sweep.method='random'"),
    ({"space": {}}, "sweep.space must name at least one config field"),
    ({"space": {"data.num_shards": [2, 4]}}, "the trials share one set of shards, so data cannot vary"),
    ({"space": {"seed": [1, 2]}}, "so seed cannot vary"),
    ({"space": {"optim.epochs": [2]}, "metric": "val_rmse"}, "sweep.metric='val_rmse' is not reported"),
    ({"space": {"optim.epochs": [2]}, "trials": 0}, "sweep.trials must be in [1, 64], got 0"),
    ({"space": {"optim.epochs": [2]}, "trails": 3}, "unknown config key 'sweep.trails' (did you mean 'sweep.trials'?)"),
])
def test_a_bad_sweep_is_refused_naming_the_field(sweep, message):
    with pytest.raises(ConfigError) as err:
        plan(_with(sweep))
    assert message in str(err.value)


def test_a_grid_over_the_trial_cap_and_a_parallel_over_the_dags_cap_are_refused():
    with pytest.raises(ConfigError, match="65 combinations, more than 64 trials"):
        plan(_with({"space": {"optim.epochs": list(range(1, 14)), "model.dropout": [0.0, 0.1, 0.2, 0.3, 0.4]}}))
    with pytest.raises(ConfigError, match=r"sweep.parallel=3 is above this DAG's cap of 2"):
        plan(_with({"space": {"optim.epochs": [2]}, "parallel": 3}), max_parallel=2)


def test_rungs_are_min_epochs_times_eta_to_the_k():
    assert [rung_of(e, 1, 3) for e in range(1, 11)] == [0, None, 1, None, None, None, None, None, 2, None]
    assert [rung_of(e, 2, 2) for e in range(1, 9)] == [None, 0, None, 1, None, None, None, 2]
    assert rung_of(5, 0, 3) is None  # no pruning
    assert rung_epochs(10, 1, 3) == [1, 3, 9] and rung_epochs(9, 1, 3) == [1, 3]  # the last epoch is no rung


def test_asha_keeps_the_best_one_in_eta_and_the_first_at_a_rung():
    assert keeps_training(0.9, [], 3, higher=False)  # alone at the rung: it goes on
    assert not keeps_training(0.9, [0.5], 3, higher=False)  # n=2, keep max(1, 0)=1: the better one only
    assert keeps_training(0.4, [0.5], 3, higher=False)
    assert keeps_training(0.9, [0.5], 3, higher=True)  # the direction matters
    # n=6, eta=3: the best two go on.
    others = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert keeps_training(0.15, others, 3, higher=False) and not keeps_training(0.25, others, 3, higher=False)
    assert not keeps_training(math.nan, [0.5], 2, higher=True)  # a NaN is the worst
    assert keeps_training(0.5, [0.5], 2, higher=False)  # a tie goes to the trial deciding


def _pruner(tmp_path, trial, higher=False):
    return Pruner(rungs_prefix=str(tmp_path / "rungs"), trial=trial, min_epochs=1, eta=2, metric="val_loss",
                  higher=higher)


def test_pruners_of_several_trials_meet_in_storage_and_a_rerun_counts_once(tmp_path):
    assert _pruner(tmp_path, 0).keeps(0, {"epoch": 0, "val_loss": 0.5})  # first at rung 0
    assert not _pruner(tmp_path, 1).keeps(0, {"epoch": 0, "val_loss": 0.7})  # worse of 2: pruned
    assert _pruner(tmp_path, 2).keeps(0, {"epoch": 0, "val_loss": 0.3})  # best of 3: n // 2 = 1 go on
    # Trial 1 resumed and replayed: its own record is overwritten, not counted twice.
    assert not _pruner(tmp_path, 1).keeps(0, {"epoch": 0, "val_loss": 0.7})
    written = sorted(p.name for p in (tmp_path / "rungs" / "0").iterdir())
    assert written == ["trial-0.json", "trial-1.json", "trial-2.json"]
    assert json.loads((tmp_path / "rungs" / "0" / "trial-1.json").read_text())["value"] == 0.7
    # Rung 1 is its own folder (not read as rung 10's, nor rung 0's).
    assert _pruner(tmp_path, 1).keeps(1, {"epoch": 1, "val_loss": 0.9})
    assert Pruner.from_job({}) is None and Pruner.from_job({"min_epochs": 0}) is None
    assert _pruner(tmp_path, 0).rung(1, 3) == 0 and _pruner(tmp_path, 0).rung(2, 2) is None  # the last epoch


def test_a_trials_value_is_its_exported_epochs():
    history = [{"epoch": 0, "val_loss": 0.5}, {"epoch": 1, "val_loss": 0.3}, {"epoch": 2, "val_loss": 0.4}]
    assert trial_value(history, "val_loss", None) == 0.4  # the last epoch's
    assert trial_value(history, "val_loss", 1) == 0.3  # the best epoch's, when that one was exported
    assert trial_value([], "val_loss", None) is None


def test_the_best_finished_trial_wins_never_a_pruned_or_failed_one_and_the_savings_add_up():
    from plugins.sweep_tasks import best_of, pruning_savings

    outcomes = [{"index": 0, "outcome": "completed", "value": 0.30, "epochs_run": 4, "epochs": 4},
                {"index": 1, "outcome": "pruned", "value": 0.10, "epochs_run": 1, "epochs": 4},
                {"index": 2, "outcome": "failed", "value": None, "epochs_run": 2, "epochs": 4},
                {"index": 3, "outcome": "stopped early", "value": 0.25, "epochs_run": 3, "epochs": 4},
                {"index": 4, "outcome": "completed", "value": math.nan, "epochs_run": 4, "epochs": 4}]
    assert best_of(outcomes, higher=False)["index"] == 3
    assert best_of(outcomes, higher=True)["index"] == 0
    assert best_of([o for o in outcomes if o["outcome"] in ("pruned", "failed")], higher=False) is None
    assert pruning_savings(outcomes) == {"sweep.trial_epochs": 14.0, "sweep.full_epochs": 20.0,
                                         "sweep.epochs_saved_share": 0.3, "sweep.epochs_saved_by_pruning": 3.0,
                                         "sweep.pruning_saved_share": 0.15}


def test_the_sweep_param_goes_over_the_configs_sweep_section_field_by_field():
    from plugins.run_config import resolve

    cfg = resolve({"recipe": "debug", "config": {"sweep": {"space": {"optim.epochs": [2, 3]}, "trials": 3}},
                   "sweep": {"min_epochs": 1, "trials": 5}})
    assert cfg.sweep.space == {"optim.epochs": [2, 3]} and (cfg.sweep.trials, cfg.sweep.min_epochs) == (5, 1)
    assert cfg.digest() == resolve({"recipe": "debug"}).digest()  # how trials are searched is no model input


def test_the_first_task_refuses_a_bad_sweep_and_the_training_dag_any_sweep_before_sharding(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from plugins import pipeline_tasks

    def no_sharding(*args, **kwargs):
        raise AssertionError("nothing may be planned, staged or sharded")

    monkeypatch.setattr(pipeline_tasks, "warm_start_checkpoint", no_sharding)
    bad = {"recipe": "debug", "sweep": {"space": {"optim.epochs": ["3"]}}}
    with pytest.raises(AirflowFailException, match=r"invalid sweep: sweep trial 0 \(optim.epochs='3'\): "
                                                   r"optim.epochs must be an integer"):
        pipeline_tasks.shard(bad, "mxnet_sweep", "r1", sweep_cap=2)
    with pytest.raises(AirflowFailException, match="sweep.parallel=3 is above this DAG's cap of 2"):
        pipeline_tasks.shard({"recipe": "debug", "sweep": {"space": {"optim.epochs": [2]}, "parallel": 3}},
                             "mxnet_sweep", "r1", sweep_cap=2)
    with pytest.raises(AirflowFailException, match="trigger the mxnet_sweep DAG"):
        pipeline_tasks.shard({"recipe": "debug", "config": {"sweep": {"space": {"optim.epochs": [2]}}}},
                             "mxnet_training", "r1")


def test_a_pruned_trial_stays_stopped_after_a_resume():
    from training.loop.resume import PRUNED_AT, TrainState, train_record

    state = TrainState(epoch=1, global_step=20, history=[{"epoch": 0}], pruned_at=0)
    assert state.stopped_early and not TrainState().stopped_early
    record = train_record(state, [], recipe("debug"), 2, {"shards": []})
    assert record[PRUNED_AT] == 0  # in the checkpoint: restore reads it back
    assert PRUNED_AT not in train_record(TrainState(), [], recipe("debug"), 2, {"shards": []})


def test_a_trials_status_record_says_whether_it_was_pruned(tmp_path):
    from training.launch.job import JobSpec
    from training.launch.status import JobStatus
    from training.launch.supervise import trial_outcome

    metrics = tmp_path / "train.json"
    job = JobSpec(config=recipe("debug"), shards_prefix="s", checkpoint_prefix="c", model_prefix="m",
                  metrics_uri=str(metrics), pruning={"min_epochs": 1})
    metrics.write_text(json.dumps({"pruned": {"epoch": 0, "metric": "val_loss"}}))
    assert trial_outcome(job) == "pruned"
    metrics.write_text(json.dumps({"history": []}))
    assert trial_outcome(job) == "completed"
    assert trial_outcome(dataclasses.replace(job, pruning={})) == ""  # not a sweep trial
    assert JobStatus.from_json(JobStatus(state="succeeded", job_id="1-x", outcome="pruned").to_json()).outcome == \
        "pruned"
    assert JobStatus.from_json(json.dumps({"state": "succeeded", "job_id": "1-x"})).outcome == ""  # an older record


def test_trials_take_a_cluster_in_plan_order_once_fewer_than_parallel_before_them_are_open():
    from common.sweep import may_take_cluster, open_before

    assert all(may_take_cluster(i, 2, set()) for i in (0, 1))  # the first `parallel` never wait
    assert not may_take_cluster(2, 2, set())
    assert may_take_cluster(2, 2, {1}) and may_take_cluster(2, 2, {0})  # any earlier trial's end frees a slot
    assert not may_take_cluster(3, 2, {0}) and may_take_cluster(3, 2, {0, 2})
    assert may_take_cluster(3, 2, {5, 0, 1}) and not may_take_cluster(3, 2, {5, 6})  # a later trial's end frees none
    assert open_before(4, {1, 3}) == [0, 2]
    assert [may_take_cluster(i, 1, set(range(i))) for i in range(4)] == [True] * 4  # one at a time, in order
    with pytest.raises(ValueError):
        may_take_cluster(0, 0, set())


@pytest.mark.parametrize("parallel", [1, 2, 3, 5])
def test_the_admission_rule_never_lets_more_than_parallel_trials_hold_a_cluster_and_every_trial_runs(parallel):
    """Many random schedules: trials end in any order, a waiting trial's gate may fail (its
    release ends without a cluster ever held), and gates are polled in any order; at no time do
    more than `parallel` trials hold a cluster, and whenever a trial waits, `parallel` do (no slot
    is left idle, no deadlock)."""
    import random

    from common.sweep import may_take_cluster

    for seed in range(200):
        rng = random.Random(seed)
        n = rng.randint(1, 12)
        ended: set[int] = set()
        holding: set[int] = set()
        waiting = list(range(n))
        peak = 0
        while waiting or holding:
            rng.shuffle(waiting)  # gates poll in no particular order
            for i in list(waiting):
                if may_take_cluster(i, parallel, ended):
                    waiting.remove(i)
                    holding.add(i)
            peak = max(peak, len(holding))
            assert len(holding) <= parallel, (seed, holding)
            assert not waiting or len(holding) == parallel, (seed, holding, waiting)
            if waiting and rng.random() < 0.2:  # a gate fails (timed out): its trial ends unheld
                failed = rng.choice(waiting)
                waiting.remove(failed)
                ended.add(failed)
                continue
            done = rng.choice(sorted(holding))  # any holder may end next
            holding.discard(done)
            ended.add(done)
        assert ended == set(range(n)) and peak <= min(parallel, n)


def test_the_gate_reads_ended_releases_from_airflows_task_states():
    from plugins.sweep_gate import ended_trials

    states = {"r1": {"trial.release_0": "success", "trial.release_1": "upstream_failed", "trial.release_2": "running",
                     "trial.release_3": None, "trial.release_4": "up_for_retry", "trial.release_5": "skipped",
                     "trial.release_6": "failed", "trial.release": "success", "trial.train_7": "success"},
              "r2": {"trial.release_8": "success"}}
    assert ended_trials(states, "r1") == {0, 1, 5, 6}  # a retry pending or an unexpanded task ends nothing
    assert ended_trials(states, "r3") == set()


def test_the_gates_trigger_waits_then_ends_the_task_itself(monkeypatch):
    import asyncio

    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from airflow.triggers.base import TaskSuccessEvent

    from plugins.sweep_gate import TrialGateTrigger

    answers = iter([RuntimeError("api down"), {"r1": {"trial.release_0": "running"}},
                    {"r1": {"trial.release_0": "running", "trial.release_1": "failed"}}])
    calls = []

    def get_task_states(**kwargs):
        calls.append(kwargs)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    trigger = TrialGateTrigger(dag_id="mxnet_sweep", run_id="r1", index=2, parallel=2, poll_s=0.01)
    classpath, kwargs = trigger.serialize()
    assert classpath == "plugins.sweep_gate.TrialGateTrigger" and TrialGateTrigger(**kwargs).index == 2

    async def first_event():
        return await asyncio.wait_for(anext(trigger.run()), timeout=10)

    event = asyncio.run(first_event())
    assert isinstance(event, TaskSuccessEvent) and len(calls) == 3  # trial 1's failure freed a slot
    assert calls[0] == {"dag_id": "mxnet_sweep", "task_ids": ["trial.release"], "run_ids": ["r1"]}


def test_the_gate_pokes_its_runs_releases_and_refuses_a_trial_mapped_out_of_plan_order():
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException

    from plugins.sweep_gate import TrialGateSensor

    released: dict[str, str] = {}

    def ti(map_index):
        return SimpleNamespace(map_index=map_index, dag_id="mxnet_sweep", run_id="r1",
                               get_task_states=lambda **kw: {"r1": dict(released)})

    gate = TrialGateSensor(task_id="gate", trial={"index": 2, "parallel": 1}, cap=3)
    assert not gate.poke({"ti": ti(2)})
    released["trial.release_0"] = "success"
    assert not gate.poke({"ti": ti(2)})  # parallel 1: trial 1 still open
    released["trial.release_1"] = "failed"
    assert gate.poke({"ti": ti(2)})
    with pytest.raises(AirflowFailException, match="map index 3 is not the trial's index 2"):
        gate.poke({"ti": ti(3)})
    released.clear()
    older = TrialGateSensor(task_id="gate", trial={"index": 2}, cap=3)  # planned before "parallel" was kept
    assert older.poke({"ti": ti(2)})  # the cap: 3 at once


# ------------------------------------------------------------------ one warm start per sweep

CHAMPION = {"registered_model_name": "digits", "warm_start": "models:/digits@champion"}


def _plan_from_a_moving_champion(monkeypatch, tmp_path) -> list:
    """``plan_trials`` of a two-trial sweep warm-started from ``models:/digits@champion``, whose
    alias moves at each resolution (``tests.unit.test_reuse.moving_champion``); MLflow's parent
    run is faked, storage is a local folder."""
    from types import SimpleNamespace

    from plugins import pipeline_tasks, sweep_tasks
    from tests.unit.test_reuse import moving_champion
    from training.tracking import runs

    moving_champion(monkeypatch)
    monkeypatch.setattr(runs, "open_run", lambda client, **kw: SimpleNamespace(info=SimpleNamespace(run_id="parent")))
    monkeypatch.setattr(runs, "log_tags", lambda *a, **kw: None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MXPIPE_LIVE_TRACKING", "0")
    config = pipeline_tasks.config_xcom(_with({"space": {"optim.learning_rate": [0.1, 0.01]}}))
    return sweep_tasks.plan_trials(config, CHAMPION, "mxnet_sweep", "run", 2)


def test_every_trial_and_retry_of_a_sweep_loads_the_warm_start_planned_though_the_alias_moved(monkeypatch, tmp_path):
    """The sweep resolves ``models:/digits@champion`` once, when it plans its trials; a new
    champion registered after that (here: at every later resolution) changes nothing: each
    trial's train task, first attempt and retry, writes a job that loads the planned checkpoint.
    The operators get the trials as the sweep DAG maps them; their prepare_job and the job
    documents are real, on a local cluster and local storage."""
    from types import SimpleNamespace

    from infra.cluster import ClusterSpec
    from infra.local_cluster import LocalCluster
    from plugins.train_operator import TrainJobOperator
    from training.launch.job import JobSpec

    trials = _plan_from_a_moving_champion(monkeypatch, tmp_path)
    assert [t["warm_start"]["checkpoint"]["prefix"] for t in trials] == ["s3://b/run-1/checkpoints"] * 2
    shards = {"manifest_digest": "m" * 64, "model_code": None, "shards_prefix": "s3://b/shards/m"}
    cluster = LocalCluster("sweep--run", ClusterSpec(run_tag="sweep--run", workers=1, servers=1),
                           str(tmp_path / "home"))
    cluster.write_record()
    started = []
    monkeypatch.setattr(LocalCluster, "start_supervisor",
                        lambda self, job_uri, **kw: started.append(job_uri) or {"host": "here"})
    loaded = []
    try:
        for trial in trials:
            op = TrainJobOperator(task_id="train", cluster=cluster.describe(), shards=shards, trial=trial)
            for try_number in (1, 2):  # the first attempt, then a retry (its job's supervisor gone)
                ti = SimpleNamespace(try_number=try_number, xcom_push=lambda **kw: None)
                job = op.submit_job({"dag": SimpleNamespace(dag_id="mxnet_sweep"), "run_id": "run", "ti": ti,
                                     "params": CHAMPION})
                loaded.append((trial["index"], try_number, JobSpec.load(job["job_uri"]).warm_start_prefix))
    finally:
        cluster.remove_record()
    assert loaded == [(i, t, "s3://b/run-1/checkpoints") for i in (0, 1) for t in (1, 2)]
    assert len(started) == 4


def test_the_sweeps_registered_inputs_name_its_warm_start_so_a_run_without_one_does_not_reuse_it(
        monkeypatch, tmp_path):
    """``select_best`` returns the inputs ``register`` tags the version with: their warm start is
    the checkpoint the sweep's trials loaded, not "none", so the training DAG's reuse check on
    the same data and config without a warm start finds the warm start changed and trains."""
    from plugins import sweep_tasks
    from training.loop.resume import model_digest
    from training.tracking.reuse import TrainingInputs, changed_inputs

    trials = _plan_from_a_moving_champion(monkeypatch, tmp_path)
    monkeypatch.setattr(sweep_tasks, "trial_outcome", lambda dag_id, t, name: {
        "index": t["index"], "run_id": t["run_id"], "label": t["label"], "state": "succeeded",
        "outcome": "completed", "value": 0.1 + t["index"], "epochs_run": 2, "epochs": 2, "trained": {"t": t["index"]}})
    monkeypatch.setattr(sweep_tasks, "_log_sweep", lambda *a: "2 completed")
    shards = {"manifest_digest": "m" * 64, "model_code": None}
    best = sweep_tasks.select_best(trials, shards, "mxnet_sweep", "run")
    assert best["trial"] == 0 and best["inputs"]["warm_start"] == "s3://b/run-1/checkpoints@10"
    registered = TrainingInputs(**best["inputs"]).tags()
    cold = TrainingInputs.of("m" * 64, model_digest(TrainConfig.from_dict(best["config"])), None, None)
    assert changed_inputs(cold, registered) == ["warm_start"]
