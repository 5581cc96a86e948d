"""What the sweep DAG's own tasks do (``plan_trials``, ``select_best``), in Airflow's terms.

The rest of a sweep is the training DAG's tasks (``plugins.pipeline_tasks``), called per trial:
a trial is keyed by its own run key ``<run id>.trial-<i>`` (``trial_run_id``), which names its
storage partition (checkpoints, model, metrics, status record), its cluster and its MLflow run,
exactly as a DAG run's id names a training run's. So a trial resumes from its own checkpoints,
has a cluster of its own and its own MLflow run; the sweep's MLflow run (the DAG run's) is the
parent of the trials' (``mlflow.parentRunId``).

``plan_trials`` expands the space (``common.sweep.plan``), opens the parent run and resolves the
sweep's warm start once (``plugins.pipeline_tasks.resolve_run_warm_start``): every trial, and
every retry of one, loads that checkpoint, even when a ``models:/…@alias`` moves mid-sweep, and
``select_best`` puts it in the training inputs the registered version is tagged with (so a later
run with another warm start, or none, does not reuse it). Each trial's train task is given its
pruning (its rungs are under the sweep's ``sweep/rungs/``, shared by every trial:
``training.loop.pruning``). ``select_best`` reads every trial's status record and
metrics from storage (a failed trial has no result to pass on through XCom, and a trial's
outcome is what its job recorded), picks the best finished one by the sweep's metric, and logs
the sweep on the parent run: the trials' outcomes and values, the cost (the sum of the trials'
``cost.*`` metrics, ``training.tracking.cost``) and the epochs the pruning saved.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from common import storage
from common.config import ConfigError
from plugins.failures import fail_without_retry
from plugins.pipeline_tasks import config_xcom, load_config, resolve_run_warm_start, run_paths

log = logging.getLogger(__name__)

# The storage stage of a sweep's own files (its rungs) under the DAG run's partition.
RUNGS = "rungs"
# Tags of the sweep's runs in MLflow: which run is a sweep (parent) or a trial, and its index.
SWEEP_TAG, TRIAL_TAG = "mxpipe.sweep", "mxpipe.sweep.trial"
# select_best's XComs: what the register task takes, as the training DAG's register does.
BEST_XCOM_KEYS = ("trained", "config", "inputs", "trial_run_id")
# The parent run's sweep cost metrics: the trials' sums of these cost metrics.
SUMMED_COST = ("cost.core_seconds", "cost.gpu_seconds", "cost.steps_trained", "cost.instance_hours", "cost.usd")


def trial_run_id(run_id: str, index: int) -> str:
    """A trial's run key: its storage partition, cluster and MLflow run are named by it."""
    return f"{run_id}.trial-{index}"


def rungs_prefix(dag_id: str, run_id: str) -> str:
    """Where every trial of the sweep writes its rung metrics: ``<sweep run>/sweep/rungs``."""
    return storage.join(run_paths(dag_id, run_id).base, "sweep", RUNGS)


def check_sweep(config: Mapping[str, Any], max_parallel: int) -> int:
    """The number of trials of the run's sweep; a sweep that cannot run fails without a retry,
    naming the field (called by the first task, before anything is sharded)."""
    from common.sweep import plan

    try:
        return len(plan(load_config(config), max_parallel=max_parallel))
    except ConfigError as exc:
        raise fail_without_retry(f"invalid sweep: {exc}") from exc


def _parent_tags(dag_id: str, run_id: str) -> dict[str, str]:
    from training.tracking.runs import dag_run_tags

    return dag_run_tags(dag_id, run_id)


def plan_trials(config: Mapping[str, Any], params: Mapping[str, Any], dag_id: str, run_id: str,
                max_parallel: int) -> list[dict[str, Any]]:
    """The trials (``common.sweep.plan``) as the mapped trial tasks take them: index (the plan's
    order, which is the map index), label, config, run key, pruning, the run's ``sweep.parallel``
    (the trial's gate admits it by it: ``plugins.sweep_gate``), the parent MLflow run's id
    (opened here, so every trial's run is its child from its start) and the sweep's warm start
    (the ``warm_start`` Param resolved here, once for the whole sweep, with the base config's
    checkpoint settings as ``shard`` checked it: ``{"reference", "checkpoint"}``)."""
    from common.sweep import metric, plan
    from training.tracking.runs import PIPELINE_EXPERIMENT, bounded_mlflow_env, dag_run_name, log_tags, open_run
    from training.tracking.server import tracking_uri

    cfg = load_config(config)
    try:
        trials = plan(cfg, max_parallel=max_parallel)
        name, higher = metric(cfg)
    except ConfigError as exc:
        raise fail_without_retry(f"invalid sweep: {exc}") from exc
    sweep = cfg.sweep
    assert sweep is not None  # plan refused a config without one
    warm = resolve_run_warm_start(params, dag_id, run_id, cfg)
    from mlflow.tracking import MlflowClient

    with bounded_mlflow_env():
        client = MlflowClient(tracking_uri())
        parent = open_run(client, experiment=PIPELINE_EXPERIMENT, run_name=dag_run_name(dag_id, run_id),
                          find_tags=_parent_tags(dag_id, run_id), tags={SWEEP_TAG: "parent"})
        parent_id = parent.info.run_id
        log_tags(client, parent_id, {"sweep.method": sweep.method, "sweep.space": json.dumps(sweep.space),
                                     "sweep.metric": name, "sweep.direction": "max" if higher else "min",
                                     "sweep.trials": str(len(trials)),
                                     "sweep.pruning": (f"ASHA min_epochs={sweep.min_epochs} eta={sweep.reduction_factor}"
                                                       if sweep.min_epochs else "off")})
    rungs = rungs_prefix(dag_id, run_id)
    log.info("sweep of %d trials (%s, %d at once at most), ranked by %s (%s); parent MLflow run %s; warm start: %s",
             len(trials), sweep.method, sweep.parallel, name, "max" if higher else "min", parent_id,
             f"{warm['reference']} ({warm['checkpoint']['prefix']} step {warm['checkpoint']['step']}) for every trial"
             if warm["checkpoint"] else "none")
    out = []
    for trial in trials:
        pruning = ({"rungs_prefix": rungs, "trial": trial.index, "min_epochs": sweep.min_epochs,
                    "eta": sweep.reduction_factor, "metric": name, "higher": higher} if sweep.min_epochs else {})
        out.append({"index": trial.index, "label": trial.label, "values": trial.values,
                    "config": config_xcom(trial.config), "run_id": trial_run_id(run_id, trial.index),
                    "parallel": sweep.parallel, "pruning": pruning, "metric": name, "higher": higher,
                    "warm_start": warm,
                    "tracking_tags": {"mlflow.parentRunId": parent_id, SWEEP_TAG: "trial",
                                      TRIAL_TAG: str(trial.index)}})
    return out


def trial_outcome(dag_id: str, trial: Mapping[str, Any], metric_name: str) -> dict[str, Any]:
    """What a trial's job recorded: ``{"index", "run_id", "state", "outcome", "value",
    "epochs_run", "epochs", "trained"}``; ``outcome`` is ``completed``, ``pruned``, ``stopped
    early`` or ``failed`` (no succeeded job: its task failed or never ran)."""
    from common.sweep import trial_value
    from training.launch.status import SUCCEEDED, read_status
    from training.train_job import job_result

    paths = run_paths(dag_id, trial["run_id"])
    epochs = int(trial["config"]["optim"]["epochs"])
    base = {"index": trial["index"], "run_id": trial["run_id"], "label": trial["label"], "epochs": epochs}
    status = read_status(paths.job_status)
    if status is None or status.state != SUCCEEDED:
        return {**base, "state": status.state if status else "none", "outcome": "failed", "value": None,
                "epochs_run": _epochs_reached(paths), "trained": None}
    job = {"metrics_uri": storage.join(paths.metrics, "train.json"), "model_prefix": paths.model,
           "checkpoint_prefix": paths.checkpoints, "resumed_from_step": 0, "attempt": status.attempt,
           "status_uri": paths.job_status}
    trained = job_result(job)
    metrics = json.loads(storage.get_bytes(job["metrics_uri"]))
    best = metrics.get("best") or {}
    exported = best.get("best_epoch") if best.get("exported") == "best" else None
    value = trial_value(metrics["history"], metric_name, exported)
    if trained["pruned"]:
        outcome = "pruned"
    elif best.get("stopped_at_epoch") is not None:
        outcome = "stopped early"
    else:
        outcome = "completed"
    return {**base, "state": status.state, "outcome": outcome, "value": value, "epochs_run": trained["epochs_run"],
            "trained": trained}


def _epochs_reached(paths: Any) -> int:
    """The epochs a failed trial's newest checkpoint holds (what it cost before it failed)."""
    from training.checkpoint.store import CheckpointStore

    try:
        latest = CheckpointStore(paths.checkpoints, keep=1).latest()
    except Exception as exc:  # noqa: BLE001 - only a figure of the summary: never fail the selection on it
        log.warning("could not read the checkpoints of %s: %s", paths.checkpoints, exc)
        return 0
    return int(latest.state.get("epoch", 0)) if latest is not None else 0


def best_of(outcomes: Sequence[Mapping[str, Any]], higher: bool) -> Mapping[str, Any] | None:
    """The best trial that ran to its end (completed or stopped early, never pruned nor failed)
    by its value; a NaN or missing value never wins. None when no trial finished."""
    finished = [o for o in outcomes if o["outcome"] in ("completed", "stopped early")
                and o["value"] is not None and not math.isnan(o["value"])]
    if not finished:
        return None
    return max(finished, key=lambda o: o["value"]) if higher else min(finished, key=lambda o: o["value"])


def pruning_savings(outcomes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Trial-epochs run against every trial run to its last epoch: the share saved in all
    (pruning and early stopping), and the epochs the pruned trials did not run."""
    run = sum(o["epochs_run"] for o in outcomes)
    full = sum(o["epochs"] for o in outcomes)
    pruned = sum(o["epochs"] - o["epochs_run"] for o in outcomes if o["outcome"] == "pruned")
    return {"sweep.trial_epochs": float(run), "sweep.full_epochs": float(full),
            "sweep.epochs_saved_share": (full - run) / full if full else 0.0,
            "sweep.epochs_saved_by_pruning": float(pruned),
            "sweep.pruning_saved_share": pruned / full if full else 0.0}


def select_best(trials: Sequence[Mapping[str, Any]], shards: Mapping[str, Any], dag_id: str,
                run_id: str) -> dict[str, Any]:
    """The best finished trial (``best_of``) with what ``register`` takes (its job result, config,
    training inputs, with the warm start the trials loaded, and run key), after logging the sweep
    on the parent run and tagging every trial's run (created here when live tracking made none).
    Fails without a retry when no trial finished."""
    from training.loop.resume import model_digest
    from training.tracking.reuse import TrainingInputs

    if not trials:
        raise fail_without_retry("select_best: the sweep planned no trial")
    name, higher = trials[0]["metric"], bool(trials[0]["higher"])
    outcomes = [trial_outcome(dag_id, t, name) for t in trials]
    for o in outcomes:
        log.info("%s: %s (%s), %s=%s after %d of %d epochs", o["label"], o["outcome"], o["state"], name, o["value"],
                 o["epochs_run"], o["epochs"])
    best = best_of(outcomes, higher)
    summary = _log_sweep(dag_id, run_id, trials, outcomes, best, name)
    if best is None:
        raise fail_without_retry(f"select_best: no trial of the sweep finished ({summary})")
    trial = next(t for t in trials if t["index"] == best["index"])
    cfg = load_config(trial["config"])
    code = shards.get("model_code") or {}
    inputs = TrainingInputs.of(shards["manifest_digest"], model_digest(cfg), code.get("sha256"),
                               trial["warm_start"]["checkpoint"])
    log.info("best trial: %s with %s=%.6g", best["label"], name, best["value"])
    return {"trained": best["trained"], "config": trial["config"], "inputs": dataclasses.asdict(inputs),
            "trial_run_id": trial["run_id"], "trial": best["index"], "value": best["value"], "metric": name,
            "summary": summary}


def _log_sweep(dag_id: str, run_id: str, trials: Sequence[Mapping[str, Any]], outcomes: Sequence[Mapping[str, Any]],
               best: Mapping[str, Any] | None, metric_name: str) -> str:
    """Tag every trial's run (child of the parent) with its outcome, and log on the parent run the
    outcomes, the best trial, the summed cost and the pruning's savings. Returns a one-line summary."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from training.tracking.runs import (PIPELINE_EXPERIMENT, bounded_mlflow_env, dag_run_name, dag_run_tags,
                                        log_tags, open_run)
    from training.tracking.server import tracking_uri

    counts = {kind: sum(1 for o in outcomes if o["outcome"] == kind)
              for kind in ("completed", "stopped early", "pruned", "failed")}
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
    metrics: dict[str, float] = {"sweep.trials": float(len(outcomes)), **pruning_savings(outcomes),
                                 **{f"sweep.{kind.replace(' ', '_')}": float(n) for kind, n in counts.items()}}
    with bounded_mlflow_env():
        client = MlflowClient(tracking_uri())
        parent = open_run(client, experiment=PIPELINE_EXPERIMENT, run_name=dag_run_name(dag_id, run_id),
                          find_tags=dag_run_tags(dag_id, run_id), tags={SWEEP_TAG: "parent"})
        for trial, o in zip(trials, outcomes):
            child = open_run(client, experiment=PIPELINE_EXPERIMENT, run_name=dag_run_name(dag_id, o["run_id"]),
                             find_tags=dag_run_tags(dag_id, o["run_id"]),
                             tags={**trial["tracking_tags"], "mlflow.parentRunId": parent.info.run_id,
                                   "sweep.outcome": o["outcome"],
                                   **{f"sweep.value.{k}": json.dumps(v) for k, v in trial["values"].items()}})
            latest = client.get_run(child.info.run_id).data.metrics
            for key in SUMMED_COST:
                if key in latest:
                    metrics[f"sweep.{key}"] = metrics.get(f"sweep.{key}", 0.0) + float(latest[key])
            if o["value"] is not None:
                metrics[f"sweep.trial_{o['index']}.{metric_name}"] = float(o["value"])
        tags = {"sweep.outcomes": summary}
        if best is not None:
            metrics.update({"sweep.best_trial": float(best["index"]), f"sweep.best_{metric_name}": float(best["value"])})
            tags["sweep.best_run_key"] = best["run_id"]
        log_tags(client, parent.info.run_id, tags)
        now = int(time.time() * 1000)
        client.log_batch(parent.info.run_id, metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics.items())],
                         synchronous=True)
    log.info("sweep: %s; cost %s; %d of %d trial-epochs run (%.0f%% saved by pruning)", summary,
             {k: round(v, 1) for k, v in metrics.items() if k.startswith("sweep.cost.")},
             metrics["sweep.trial_epochs"], metrics["sweep.full_epochs"], 100 * metrics["sweep.epochs_saved_share"])
    return summary
