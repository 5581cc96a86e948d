"""Issue 27's faults injected into training DAG runs on the namespace topology (``infra.topology``),
each run compared with an uninterrupted run of the same config and seed.

A fault is a function ``inject(ctx)`` that waits for its moment in the run (a task running on a
worker host, the train task deferred, ...), breaks something, repairs what a person would
(restarts the killed servers) and returns what it measured. ``fault_run`` triggers the run, lets
the fault act, waits for the end and returns the run's outcome: state, task states and tries, the
digest of its final checkpoint's parameters and of the registered model's parameter file.
``benchmarks/topology_faults.py`` runs every fault once; the ``-m topology`` tests the cheap ones.

The faults (``FAULTS``):

- ``worker_shard`` / ``worker_register``: every process of the Celery worker host running a
  ``shard_part`` (``register``) task killed; the scheduler fails the lost attempt once its
  heartbeats stop (``[scheduler] task_instance_heartbeat_timeout``) and retries it on the other
  worker. The killed worker is started again after the run.
- ``triggerer``: every process of the triggerer host killed while the train task is deferred, and
  the triggerer started again 5 s later: the job trains on, the new triggerer takes the trigger.
- ``postgres``: PostgreSQL stopped (fast shutdown: every connection cut) and started while the
  train task is deferred.
- ``s3_link``: the S3 host's link down for 20 s while training, then up.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import storage
from common.paths import RunPaths
from infra import netns
from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag, wait_for_dag_run
from infra.topology import (HOSTS, TopologySettings, client_env, restart_airflow_server, restart_postgres)
from testkit.topology_runs import use_topology_s3

log = logging.getLogger(__name__)

DAG_ID = "mxnet_training"
MODEL_NAME = "digits-faults"
# Long enough for a fault to land mid-training with time to spare: the debug recipe's 3 epochs
# train in seconds.
EPOCHS = 12
LINK_DOWN_S = 20.0
TRIGGERER_RESTART_AFTER_S = 5.0
POLL_S = 0.5
RUN_TIMEOUT_S = 1500.0  # one run on the loaded 2-core machine, with a fault's retries and delays
WAIT_TIMEOUT_S = 900.0  # a fault's moment (the task it waits for) comes within this


@dataclass
class FaultContext:
    root: Path
    settings: TopologySettings
    client: AirflowClient
    run_id: str
    events: list[tuple[float, str]] = field(default_factory=list)

    def note(self, what: str) -> float:
        t = time.monotonic()
        self.events.append((t, what))
        log.info("fault: %s", what)
        return t

    def instances(self) -> list[dict[str, Any]]:
        return self.client.task_instances(DAG_ID, self.run_id)

    def wait_for(self, what: str, pick: Callable[[list[dict[str, Any]]], Any],
                 timeout_s: float = WAIT_TIMEOUT_S) -> Any:
        """Poll the run's task instances until ``pick`` returns something; fails if the run ends first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = pick(self.instances())
            if found:
                return found
            if self.client.dag_run(DAG_ID, self.run_id)["state"] in ("success", "failed"):
                raise RuntimeError(f"the run ended before {what}")
            time.sleep(POLL_S)
        raise TimeoutError(f"no {what} within {timeout_s:.0f}s")

    def host_of(self, address: str) -> str:
        return next(h for h in HOSTS if self.settings.address(h) == address)


def _running(task_id: str) -> Callable[[list[dict[str, Any]]], Any]:
    def pick(tis: list[dict[str, Any]]) -> Any:
        return next((ti for ti in tis if ti["task_id"] == task_id and ti["state"] == "running" and ti["hostname"]),
                    None)
    return pick


def _deferred_train(tis: list[dict[str, Any]]) -> Any:
    ti = next((ti for ti in tis if ti["task_id"] == "train"), None)
    trigger = (ti or {}).get("trigger") or {}
    return ti if ti and ti["state"] == "deferred" and trigger.get("triggerer_id") else None


def kill_host(settings: TopologySettings, host: str) -> list[int]:
    """SIGKILL every process in ``host``'s namespace: the host lost, as a power cut loses it."""
    pids = netns.netns_pids(settings.namespace(host))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while netns.netns_pids(settings.namespace(host)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def _newest_step(run_id: str, bucket: str) -> int:
    from common.config import CheckpointConfig
    from training.checkpoint.store import store_for

    steps = store_for(RunPaths(f"s3://{bucket}/runs", DAG_ID, run_id).checkpoints, CheckpointConfig()).committed_steps()
    return max(steps, default=0)


def _wait_new_checkpoint(ctx: FaultContext, after_step: int, bucket: str, timeout_s: float = WAIT_TIMEOUT_S) -> int | None:
    """The first step committed past ``after_step`` (None if training ended first): training is back on track."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            step = _newest_step(ctx.run_id, bucket)
        except Exception as exc:  # S3 may still be settling; this is a probe, retried until the deadline
            log.info("checkpoint probe: %s", exc)
            step = 0
        if step > after_step:
            return step
        train = next((ti for ti in ctx.instances() if ti["task_id"] == "train"), {})
        if train.get("state") in ("success", "failed", "up_for_retry"):
            return None
        time.sleep(1.0)
    raise TimeoutError(f"no checkpoint past step {after_step} within {timeout_s:.0f}s")


# ---------------------------------------------------------------------------------------------
# the faults


def _kill_worker_mid(task_id: str) -> Callable[[FaultContext], dict[str, Any]]:
    def inject(ctx: FaultContext) -> dict[str, Any]:
        ti = ctx.wait_for(f"{task_id} running", _running(task_id))
        host = ctx.host_of(ti["hostname"])
        t_kill = ctx.note(f"kill every process of {host} ({task_id} try {ti['try_number']} running there)")
        pids = kill_host(ctx.settings, host)

        def retried(tis: list[dict[str, Any]]) -> Any:
            return next((t for t in tis if t["task_id"] == task_id and t["map_index"] == ti["map_index"]
                         and t["try_number"] > ti["try_number"] and t["state"] == "running"), None)

        again = ctx.wait_for(f"{task_id} retried", retried)
        t_retry = ctx.note(f"{task_id} try {again['try_number']} running on {ctx.host_of(again['hostname'])}")

        def done(tis: list[dict[str, Any]]) -> Any:
            return next((t for t in tis if t["task_id"] == task_id and t["map_index"] == ti["map_index"]
                         and t["state"] in ("success", "failed")), None)

        end = ctx.wait_for(f"{task_id} done", done)
        t_done = ctx.note(f"{task_id} {end['state']} (try {end['try_number']})")
        restart_airflow_server(ctx.root, host, "celery-worker")
        ctx.note(f"celery worker on {host} started again")
        return {"task": task_id, "killed_host": host, "killed_processes": len(pids),
                "retried_on": ctx.host_of(again["hostname"]), "retry_try_number": again["try_number"],
                "final_state": end["state"], "kill_to_retry_running_s": round(t_retry - t_kill, 1),
                "recovery_s": round(t_done - t_kill, 1)}
    return inject


def _kill_triggerer(ctx: FaultContext) -> dict[str, Any]:
    ti = ctx.wait_for("train deferred", _deferred_train)
    old = ti["trigger"]["triggerer_id"]
    time.sleep(3.0)  # into training, past its first polls
    t_kill = ctx.note(f"kill every process of triggerer (trigger {ti['trigger']['id']} on triggerer job {old})")
    pids = kill_host(ctx.settings, "triggerer")
    time.sleep(TRIGGERER_RESTART_AFTER_S)
    restart_airflow_server(ctx.root, "triggerer", "triggerer")
    t_restart = ctx.note("triggerer started again")

    def taken_up(tis: list[dict[str, Any]]) -> Any:
        train = next((t for t in tis if t["task_id"] == "train"), {})
        trig = train.get("trigger") or {}
        if train.get("state") != "deferred":
            return train  # the job ended and the task resumed: taken up (or ended) either way
        return train if trig.get("triggerer_id") not in (None, old) else None

    train = ctx.wait_for("the trigger taken up by the new triggerer", taken_up)
    t_up = ctx.note(f"train {train['state']}, trigger on triggerer job {(train.get('trigger') or {}).get('triggerer_id')}")
    return {"killed_processes": len(pids), "old_triggerer_job": old,
            "new_triggerer_job": (train.get("trigger") or {}).get("triggerer_id"),
            "restart_to_taken_up_s": round(t_up - t_restart, 1), "recovery_s": round(t_up - t_kill, 1)}


def _restart_postgres(ctx: FaultContext) -> dict[str, Any]:
    ctx.wait_for("train deferred", _deferred_train)
    time.sleep(3.0)
    t_stop = ctx.note("PostgreSQL fast shutdown and start")
    restart_postgres(ctx.root)
    t_up = ctx.note("PostgreSQL up again")
    back = datetime.now(timezone.utc)

    def healthy() -> bool:
        """The database answers and the scheduler, triggerer and DAG processor have each
        heartbeaten since PostgreSQL came back (a heartbeat of before would still read healthy
        for [scheduler] scheduler_health_check_threshold seconds while the server was dead)."""
        try:
            health = ctx.client.request("GET", "/monitor/health").json()
        except Exception as exc:  # the API server itself may answer 500 while its pool reconnects
            log.info("health: %s", exc)
            return False
        if health.get("metadatabase", {}).get("status") != "healthy":
            return False
        for component in ("scheduler", "triggerer", "dag_processor"):
            beat = health.get(component, {}).get(f"latest_{component}_heartbeat")
            if not beat or datetime.fromisoformat(beat) <= back:
                return False
        return True

    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not healthy():
        if time.monotonic() > deadline:
            raise TimeoutError("Airflow not healthy after PostgreSQL's restart")
        time.sleep(1.0)
    t_healthy = ctx.note("Airflow healthy: the scheduler, triggerer and DAG processor heartbeat again")
    return {"postgres_down_s": round(t_up - t_stop, 1), "restart_to_healthy_s": round(t_healthy - t_up, 1),
            "recovery_s": round(t_healthy - t_stop, 1)}


def _s3_link_down(ctx: FaultContext) -> dict[str, Any]:
    ctx.wait_for("train deferred", _deferred_train)
    bucket = client_env(ctx.root)["bucket"]
    step = _wait_new_checkpoint(ctx, 0, bucket)  # a checkpoint committed: the job trains
    ns = ctx.settings.namespace("s3")
    t_down = ctx.note(f"S3 host's link down (checkpoint step {step} committed)")
    netns.ip("-n", ns, "link", "set", "eth0", "down")
    try:
        time.sleep(LINK_DOWN_S)
    finally:
        netns.ip("-n", ns, "link", "set", "eth0", "up")
    t_up = ctx.note("S3 host's link up")
    before = _newest_step(ctx.run_id, bucket)
    new = _wait_new_checkpoint(ctx, before, bucket)
    t_new = ctx.note(f"checkpoint step {new} committed after the outage")
    return {"link_down_s": round(t_up - t_down, 1), "step_before": before, "first_step_after": new,
            "link_up_to_next_checkpoint_s": round(t_new - t_up, 1) if new else None,
            "recovery_s": round(t_new - t_down, 1) if new else None}


FAULTS: dict[str, Callable[[FaultContext], dict[str, Any]]] = {
    "worker_shard": _kill_worker_mid("shard_part"),
    "worker_register": _kill_worker_mid("register"),
    "triggerer": _kill_triggerer,
    "postgres": _restart_postgres,
    "s3_link": _s3_link_down,
}


# ---------------------------------------------------------------------------------------------
# a run


def params_digest(run_id: str, bucket: str) -> dict[str, Any]:
    """The run's final checkpoint (step and sha256 of its parameters, array by array) and the
    sha256 of the registered model's parameter files."""
    import numpy as np

    from common.config import CheckpointConfig
    from training.checkpoint.store import store_for

    paths = RunPaths(f"s3://{bucket}/runs", DAG_ID, run_id)
    store = store_for(paths.checkpoints, CheckpointConfig())
    step = max(store.committed_steps())
    digest = hashlib.sha256()
    with np.load(io.BytesIO(store.load(step).files["params.npz"])) as arrays:
        for name in sorted(arrays.files):
            digest.update(name.encode() + arrays[name].tobytes())
    model = hashlib.sha256()
    files = sorted(u for u in storage.list_uris(paths.model) if u.endswith(".params"))
    for uri in files:
        model.update(storage.get_bytes(uri))
    return {"step": step, "checkpoint_params_sha256": digest.hexdigest(),
            "model_params_sha256": model.hexdigest() if files else None}


def fault_run(root: Path, csv: bytes, label: str, fault: str | None = None,
              timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One training DAG run on digits (hosts backend, 2 workers, 1 server), ``fault`` injected
    into it (None: the uninterrupted baseline). Each run reads its own copy of the table, so it
    shards afresh (a shard_part to kill) and trains (no reuse): same bytes, same shards."""
    env = use_topology_s3(root)
    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    uri = f"s3://{env['bucket']}/topology-faults/{label}/digits.csv"
    storage.put_bytes(uri, csv)
    wait_for_dag(env["airflow_url"], DAG_ID, timeout_s=300, dag_file="mxnet_training.py")
    conf = {"dataset_uri": uri, "recipe": "debug", "registered_model_name": MODEL_NAME, "backend": "hosts",
            "num_workers": 2, "num_servers": 1, "force": True, "config": {"optim": {"epochs": EPOCHS}}}
    t0 = time.monotonic()
    run_id = trigger_dag_run(env["airflow_url"], DAG_ID, conf)
    measured: dict[str, Any] = {}
    error = None
    with AirflowClient(env["airflow_url"]) as client:
        ctx = FaultContext(root, settings, client, run_id)
        if fault:
            try:
                measured = FAULTS[fault](ctx)
            except Exception as exc:  # recorded with the run's outcome: the report says what broke
                log.exception("fault %s", fault)
                error = f"{type(exc).__name__}: {exc}"
        state = wait_for_dag_run(env["airflow_url"], DAG_ID, run_id, timeout_s=timeout_s, poll_s=2)
        seconds = time.monotonic() - t0
        tis = client.task_instances(DAG_ID, run_id)
        registered = None
        if state == "success":
            path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/register/xcomEntries/return_value"
            registered = client.request("GET", path, params={"deserialize": "true"}).json()["value"]
    out: dict[str, Any] = {
        "label": label, "fault": fault, "run_id": run_id, "state": state, "seconds": round(seconds, 1),
        "states": {f"{t['task_id']}[{t['map_index']}]" if t["map_index"] >= 0 else t["task_id"]: t["state"] for t in tis},
        "tries": {t["task_id"]: t["try_number"] for t in tis if t["try_number"] > 1},
        "events": [(round(t - t0, 1), what) for t, what in ctx.events], "measured": measured, "error": error,
        "registered": {k: registered.get(k) for k in ("version", "test_accuracy", "model_uri", "run_id")
                       if k in registered} if isinstance(registered, dict) else registered}
    if state == "success":
        out["params"] = params_digest(run_id, env["bucket"])
        out["versions_of_the_run"] = versions_of_run(env["mlflow_uri"], out["registered"]["run_id"])
    return out


def versions_of_run(mlflow_uri: str, mlflow_run_id: str) -> int:
    """How many model versions the run's MLflow run registered: 1, also after a retried register."""
    from mlflow import MlflowClient

    found = MlflowClient(tracking_uri=mlflow_uri).search_model_versions(
        f"name='{MODEL_NAME}' and run_id='{mlflow_run_id}'")
    return len(found)


def same_params(run: dict[str, Any], baseline: dict[str, Any]) -> bool:
    return bool(run.get("params")) and run["params"] == baseline.get("params")
