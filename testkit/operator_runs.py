"""What the real-scheduler tests of the training operator share: the stack, the run's conf,
waiting for its job to train, its status record, its role processes, the orderly-stop checks,
and the final parameters and per-step records that the durability tests compare with an
uninterrupted run's. Every helper takes the run's ``dag_id`` (the shipped DAG's unless given):
the stack also runs the DAG's test variants (``dags_operator_variants.py``)."""
from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from common import storage
from common.paths import RunPaths
from infra.airflow_client import AirflowClient, wait_for_task_state
from testkit import ROOT
from training.launch.status import read_status

DAG_ID = "mxnet_training"
EXTRA_ENV = {"MXPIPE_FAULT_STEP_DELAY_S": "0.4"}
# A task whose heartbeats stop is failed (and retried) after 30 s rather than Airflow's 300. The
# scheduler's setting, for every DAG of the stack; a deferred task has no heartbeat to miss.
HEARTBEAT_ENV = {"AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
                 "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5"}
# The operator polling in its task process (every DAG of a stack).
SYNC_ENV = {"MXPIPE_TRAIN_DEFERRABLE": "0", **HEARTBEAT_ENV}
# The stack with the shipped DAG and its test variants.
VARIANTS_ENV = {**EXTRA_ENV, **HEARTBEAT_ENV}
# The orderly stop: preempt_grace_s (30 s) for rank 0, the other roles' grace, the last write.
STOP_BOUND_S = 30 + 1 + 5 + 20


def operator_stack(home: Any, s3_server: Any, mlflow_server: Any, **env: str) -> Any:
    """The real Airflow stack (``airflow_stack``) with the training DAG, every step slowed, and
    ``env`` for its components and tasks."""
    from testkit.airflow_stack import airflow_stack

    return airflow_stack(home, s3_server, mlflow_server, {DAG_ID: "mxnet_training.py"},
                         extra_env={**EXTRA_ENV, **env})


def variants_stack(home: Path, s3_server: Any, mlflow_server: Any, variants: Iterable[str]) -> Any:
    """The real Airflow stack parsing the shipped training DAG and its test variants
    (``dags_operator_variants.py``, the ids ``variants``), steps slowed, ``VARIANTS_ENV``: one
    stack for runs that need different DAG-level limits. Its DAG folder links both files."""
    from testkit.airflow_stack import airflow_stack

    folder = home / "dag-files"
    folder.mkdir(parents=True)
    for source in (ROOT / "dags" / "mxnet_training.py", Path(__file__).with_name("dags_operator_variants.py")):
        (folder / source.name).symlink_to(source)
    dags = {DAG_ID: "mxnet_training.py", **{v: "dags_operator_variants.py" for v in variants}}
    return airflow_stack(home, s3_server, mlflow_server, dags, extra_env=VARIANTS_ENV, dags_folder=folder)


@pytest.fixture(scope="module")
def digits_uri(s3_server: Any, digits_csv: bytes) -> str:
    """The digits table on the session's S3 server (a module imports this fixture)."""
    uri = f"s3://{s3_server.bucket}/datasets/digits-operator.csv"
    storage.put_bytes(uri, digits_csv)
    return uri


def conf(uri: str, **kw: Any) -> dict[str, Any]:
    return {"dataset_uri": uri, "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 4,
            "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
            "kvstore": "dist_sync", "checkpoint_every_n_steps": 10,
            # force: these runs are about training (kills, timeouts, restarts); an earlier run's
            # version on the same inputs would otherwise be reused and nothing trained.
            "registered_model_name": "digits-operator", "force": True, **kw}


def run_paths(s3_server: Any, run_id: str, dag_id: str = DAG_ID) -> RunPaths:
    return RunPaths(root=s3_server.env["MXPIPE_ARTIFACT_ROOT"], dag_id=dag_id, run_id=run_id)


def status_uri(s3_server: Any, run_id: str, dag_id: str = DAG_ID) -> str:
    return run_paths(s3_server, run_id, dag_id).job_status


def wait_training(s3_server: Any, cfg: Any, run_id: str, min_step: int, timeout_s: float = 600,
                  task_state: str = "deferred", dag_id: str = DAG_ID) -> Any:
    """The job running past ``min_step`` with the train task in ``task_state``; its status record."""
    wait_for_task_state(cfg.airflow_url, dag_id, run_id, "train", task_state, timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(status_uri(s3_server, run_id, dag_id))
        if status is not None and status.state == "running" and status.global_step >= min_step:
            with AirflowClient(cfg.airflow_url) as client:
                assert client.task_states(dag_id, run_id)["train"] == task_state
            return status
        time.sleep(1)
    raise TimeoutError(f"the job of {dag_id} {run_id} did not pass step {min_step} within {timeout_s}s")


def train_ti(cfg: Any, run_id: str, dag_id: str = DAG_ID) -> dict[str, Any]:
    with AirflowClient(cfg.airflow_url) as client:
        return next(t for t in client.task_instances(dag_id, run_id) if t["task_id"] == "train")


def role_processes(run_id: str, dag_id: str = DAG_ID) -> list[int]:
    """The pids of this run's role and supervisor processes (each carries its cluster's id)."""
    from common.procs import tagged_processes
    from infra.cluster import cluster_id_for

    return tagged_processes("MXPIPE_CLUSTER", cluster_id_for(f"{dag_id}--{run_id}"))


def alive(pid: int) -> bool:
    """Running, not merely a zombie: the detached supervisor's parent is whichever process
    adopted it (an Airflow process acting as subreaper), which reaps it when it pleases."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def mark_failed_and_wait_stopped(s3_server: Any, cfg: Any, home: Any, run_id: str, seen: Any,
                                 dag_id: str = DAG_ID) -> float:
    """Mark the run failed (the REST API, as the UI does), check the orderly stop
    (``check_stopped_in_order``); the seconds from the request until no process was left."""
    started = time.monotonic()
    with AirflowClient(cfg.airflow_url) as client:
        client.request("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
    check_stopped_in_order(s3_server, home, run_id, seen, started, dag_id)
    return time.monotonic() - started


def check_stopped_in_order(s3_server: Any, home: Any, run_id: str, seen: Any, started: float,
                           dag_id: str = DAG_ID) -> Any:
    """The job ended ``stopped`` within the bound, its emergency checkpoint committed at or after
    the step seen before the stop, no process of the run left; the final status record."""
    from training.checkpoint.store import CheckpointStore

    deadline = started + STOP_BOUND_S + 60
    while time.monotonic() < deadline:
        status = read_status(status_uri(s3_server, run_id, dag_id))
        if status.state != "running":
            break
        time.sleep(1)
    assert status.state == "stopped", status
    newest = CheckpointStore(run_paths(s3_server, run_id, dag_id).checkpoints).committed_steps()[0]
    assert newest >= seen.global_step
    logs = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(home / "jobs")
                   for f in files if f == f"{status.job_id}.log")
    assert f"emergency checkpoint at step {newest} committed" in logs, logs[-3000:]
    wait_until = time.monotonic() + 120
    while role_processes(run_id, dag_id) and time.monotonic() < wait_until:
        time.sleep(1)
    assert not role_processes(run_id, dag_id)
    assert not alive(status.pid)
    return status


def trained_steps(s3_server: Any, run_id: str, dag_id: str = DAG_ID) -> tuple[list[int], int]:
    """The per-step records of the run's training (``step_history``) and its final global step."""
    metrics = json.loads(storage.get_bytes(storage.join(run_paths(s3_server, run_id, dag_id).metrics,
                                                        "train.json")))
    return [r["step"] for r in metrics["step_history"]], metrics["global_step"]


def final_params(s3_server: Any, run_id: str, dag_id: str = DAG_ID) -> tuple[int, dict[str, Any]]:
    """The step and parameters of the run's newest committed checkpoint."""
    import numpy as np

    from training.checkpoint.store import CheckpointStore

    ckpt = CheckpointStore(run_paths(s3_server, run_id, dag_id).checkpoints).latest()
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return ckpt.step, {k: arrays[k].copy() for k in arrays.files}


def assert_same_params(got: tuple[int, dict[str, Any]], reference: tuple[int, dict[str, Any]]) -> None:
    """The same final step and parameters within 1e-6 (test_checkpoint_resume's bound)."""
    import numpy as np

    assert got[0] == reference[0], (got[0], reference[0])
    assert sorted(got[1]) == sorted(reference[1])
    diff = max(float(np.max(np.abs(got[1][k] - reference[1][k]))) for k in got[1])
    assert diff <= 1e-6, diff


def task_processes(ti_id: str) -> list[Any]:
    """The task runner of task instance ``ti_id`` (its title names the id) and the LocalExecutor
    worker that forked it."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if f"airflow worker -- {ti_id}" in " ".join(proc.info["cmdline"] or []):
            return [proc.parent(), proc]
    raise LookupError(f"no task runner process for task instance {ti_id}")
