"""O1-O3: what the durable, deferrable train task changes, measured on the real Airflow stack
(api-server, scheduler with the LocalExecutor, dag-processor, triggerer; the roles on the
local backend) against a SeaweedFS S3 and an MLflow server of the benchmark's own. Every step
is slowed (``MXPIPE_FAULT_STEP_DELAY_S``) so each act lands mid-training.

- O1, worker slots held while a job trains: sampled every 2 s for ``--sample-s`` seconds of
  training, as the train task instances in state ``running`` and as the LocalExecutor worker
  processes busy with a workload (their process title), in both modes of the operator:
  deferrable (the default: the task is ``deferred``) and synchronous (``MXPIPE_TRAIN_DEFERRABLE=0``,
  the task process polls the job: what the former ``@task`` train did, whose process was the
  supervisor, holding its slot for the whole training).
- O2, steps lost to an Airflow restart mid-training: deferrable, ``kill -9`` of the scheduler's
  and the triggerer's whole sessions (the executor workers with them) and a restart;
  synchronous, ``kill -9`` of the task runner and the executor worker running it (the task is
  retried after its missed heartbeats and reconnects). Steps recomputed come from the job logs
  of the run (``$MXPIPE_HOME/jobs/<cluster>/<job id>.log``): for each job after the first, the
  steps the earlier jobs reached past its ``resumed from step R``; with the jobs started.
- O3, mark the run failed mid-training → every role stopped: seconds from the request until no
  process of the run is left, and the step of the emergency checkpoint rank 0 committed first.

    .venv/bin/python benchmarks/operator_durability.py [--sample-s S] [--json OUT]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.dag_services import embedded_services, use_in_this_process  # noqa: E402
from testkit.dag_stack import upload  # noqa: E402
from testkit.result_file import write_json  # noqa: E402

# Long enough (about 20 steps an epoch, 0.4 s a step) to outlast the sampling and the act after it.
LONG_EPOCHS = 10
STEP = re.compile(r"global_step=(\d+)")
RESUMED = re.compile(r"resumed from step (\d+)")


def busy_executor_workers(stack_home: Path) -> int:
    """LocalExecutor worker processes of this stack's scheduler (its session) running a
    workload: an idle one's title says ``<idle>`` (padded with NULs where the title it replaced
    was longer). Their environment cannot tell the stack: setting the title overwrites it."""
    import psutil

    from infra.processes import load_handle

    scheduler = load_handle(stack_home, "airflow-scheduler")
    busy = 0
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith("airflow worker -- LocalExecutor") and "<idle>" not in title:
            with contextlib.suppress(OSError):
                busy += scheduler is not None and os.getsid(proc.pid) == scheduler.pgid
    return busy


def sample_slots(cfg: Any, run_id: str, seconds: float) -> dict[str, float]:
    from infra.airflow_client import AirflowClient
    from testkit.operator_runs import DAG_ID

    tis, workers = [], []
    deadline = time.monotonic() + seconds
    with AirflowClient(cfg.airflow_url) as client:
        while time.monotonic() < deadline:
            tis.append(sum(s == "running" for s in client.task_states(DAG_ID, run_id).values()))
            workers.append(busy_executor_workers(cfg.home))
            time.sleep(2)
    return {"samples": len(tis), "running_tis_mean": sum(tis) / len(tis), "running_tis_max": max(tis),
            "busy_workers_mean": sum(workers) / len(workers), "busy_workers_max": max(workers)}


def steps_recomputed(home: Path, run_id: str) -> dict[str, int]:
    from infra.cluster import cluster_id_for
    from testkit.operator_runs import DAG_ID

    logs = sorted((home / "jobs" / cluster_id_for(f"{DAG_ID}--{run_id}")).glob("*.log"),
                  key=lambda p: p.stat().st_mtime)
    reached, recomputed = 0, 0
    for log in logs:
        text = log.read_text(errors="replace")
        if reached and (resumed := RESUMED.search(text)):
            recomputed += max(0, reached - int(resumed.group(1)))
        reached = max([reached, *(int(m) for m in STEP.findall(text))])
    return {"jobs_started": len(logs), "steps_recomputed": recomputed, "final_step": reached}


@contextlib.contextmanager
def jobs_stopped_on_the_way_out(run_ids: list[str]) -> Iterator[list[str]]:
    """On any way out (an interrupt, a failed step) the runs' detached supervisors and roles,
    which outlive the stack by design, are killed."""
    from testkit.operator_runs import role_processes

    try:
        yield run_ids
    finally:
        for run_id in run_ids:
            for pid in role_processes(run_id):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _servers(cfg: Any, services: dict[str, str]) -> tuple[Any, Any]:
    """What ``tests/integration/airflow_stack`` reads from its S3 and MLflow fixtures."""
    s3 = SimpleNamespace(endpoint=cfg.s3_endpoint, access_key=services["AWS_ACCESS_KEY_ID"],
                         secret_key=services["AWS_SECRET_ACCESS_KEY"], bucket=cfg.bucket,
                         env={"MXPIPE_ARTIFACT_ROOT": f"s3://{cfg.bucket}/o-bench"})
    return s3, SimpleNamespace(tracking_uri=cfg.mlflow_uri)


def deferrable_runs(root: Path, s3: Any, mlflow: Any, dataset: str, sample_s: float,
                    runs: list[str]) -> dict[str, Any]:
    """O3 (mark failed), then O1 and O2 on one run (the restart comes last: it ends the stack's
    scheduler and triggerer with it)."""
    from testkit.airflow_stack import killed_and_restarted, stack_client_env
    from infra.airflow_client import trigger_dag_run, wait_for_dag_run
    from testkit.operator_runs import (DAG_ID, EXTRA_ENV, conf, mark_failed_and_wait_stopped, operator_stack, run_paths,
                               train_ti, wait_training)
    from training.checkpoint.store import CheckpointStore

    home = root / "deferrable"
    out: dict[str, Any] = {}
    with operator_stack(home, s3, mlflow) as cfg:
        run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(dataset, epochs=8))
        runs.append(run_id)
        seen = wait_training(s3, cfg, run_id, min_step=15)
        stop_s = mark_failed_and_wait_stopped(s3, cfg, home, run_id, seen)
        out["mark_failed"] = {"stop_s": stop_s, "step_at_request": seen.global_step,
                              "emergency_checkpoint_step":
                                  CheckpointStore(run_paths(s3, run_id).checkpoints).committed_steps()[0],
                              "train_try_number": train_ti(cfg, run_id)["try_number"]}
        print("O3", json.dumps(out["mark_failed"]), flush=True)

        run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(dataset, epochs=LONG_EPOCHS))
        runs.append(run_id)
        wait_training(s3, cfg, run_id, min_step=5)
        out["slots"] = sample_slots(cfg, run_id, sample_s)
        print("O1 deferrable", json.dumps(out["slots"]), flush=True)
        client_env = stack_client_env(home, s3, mlflow, EXTRA_ENV)
        with killed_and_restarted(cfg, client_env, ["scheduler", "triggerer"]):
            state = wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=900)
            try_number = train_ti(cfg, run_id)["try_number"]
    out["restart"] = {"what": "kill -9 of the scheduler and triggerer sessions, restarted", "dag_run": state,
                      "train_try_number": try_number, **steps_recomputed(home, run_id)}
    print("O2 deferrable", json.dumps(out["restart"]), flush=True)
    return out


def synchronous_runs(root: Path, s3: Any, mlflow: Any, dataset: str, sample_s: float,
                     runs: list[str]) -> dict[str, Any]:
    """O1 and O2 with the task polling in its own process."""
    from infra.airflow_client import trigger_dag_run, wait_for_dag_run
    from testkit.operator_runs import DAG_ID, SYNC_ENV, conf, operator_stack, task_processes, train_ti, wait_training

    home = root / "synchronous"
    out: dict[str, Any] = {}
    with operator_stack(home, s3, mlflow, **SYNC_ENV) as cfg:
        run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(dataset, epochs=LONG_EPOCHS))
        runs.append(run_id)
        wait_training(s3, cfg, run_id, min_step=5, task_state="running")
        out["slots"] = sample_slots(cfg, run_id, sample_s)
        print("O1 synchronous", json.dumps(out["slots"]), flush=True)
        for proc in task_processes(train_ti(cfg, run_id)["id"]):
            proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        state = wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=900)
        out["restart"] = {"what": "kill -9 of the task runner and its LocalExecutor worker", "dag_run": state,
                          "train_try_number": train_ti(cfg, run_id)["try_number"],
                          "kill_to_run_end_s": time.monotonic() - killed, **steps_recomputed(home, run_id)}
    print("O2 synchronous", json.dumps(out["restart"]), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample-s", type=float, default=20.0, help="seconds of training sampled for O1")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mxpipe-operator-") as tmp:
        root = Path(tmp)
        with embedded_services(root) as (cfg, services):
            use_in_this_process(services)
            s3, mlflow = _servers(cfg, services)
            dataset = f"s3://{cfg.bucket}/datasets/digits.csv"
            upload({**os.environ, **services}, dataset)
            with jobs_stopped_on_the_way_out([]) as runs:
                result = {"deferrable": deferrable_runs(root, s3, mlflow, dataset, args.sample_s, runs),
                          "synchronous": synchronous_runs(root, s3, mlflow, dataset, args.sample_s, runs)}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
