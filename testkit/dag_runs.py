"""``dag.test()`` runs of a DAG in one child process with its own AIRFLOW_HOME (a migrated SQLite
database): the one DagBag runner script of the tests and benchmarks.

Several confs run in the same child (Airflow's import costs seconds here); each conf's outcome
is either the finished run (state, run id, its seconds from start to end, every task instance
with its map index, rendered name, state, try number and duration, and the XComs asked for) or
the exception that refused it, with its message, so a test can check both a rejected trigger
and a failed run. The parsed DAG's
timetable and task ids come back too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from testkit import REPO

DAGS = os.path.join(REPO, "dags")

RUNNER = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.models.dagrun import DagRun
from airflow.utils.session import create_session
dags_folder, dag_id, confs, xcom_tasks = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
bag = DagBag(dags_folder)
assert not bag.import_errors, bag.import_errors
dag = bag.dags[dag_id]
results = []
for conf in confs:
    try:
        dr = dag.test(run_conf=conf)
    except Exception as exc:  # a refused trigger: the message is what the user sees
        results.append({"rejected": type(exc).__name__, "message": str(exc)})
        continue
    tis = dr.get_task_instances()
    results.append({"state": str(dr.state), "run_id": dr.run_id,
                    "seconds": (dr.end_date - dr.start_date).total_seconds() if dr.end_date and dr.start_date else None,
                    "task_instances": [{"task_id": ti.task_id, "map_index": ti.map_index,
                                        "name": ti.rendered_map_index, "state": str(ti.state),
                                        "try_number": ti.try_number, "duration": ti.duration} for ti in tis],
                    "xcom": {t: ti.xcom_pull(task_ids=t) for ti in tis[:1] for t in xcom_tasks}})
with create_session() as session:
    runs = session.query(DagRun).filter(DagRun.dag_id == dag_id).count()
print("DAGRUN_RESULTS " + json.dumps({"results": results, "dag_runs": runs,
                                      "dag": {"timetable": type(dag.timetable).__name__,
                                              "task_ids": [t.task_id for t in dag.tasks]}}))
"""


def airflow_env(home: str | Path, *, dags_folder: str = DAGS, migrate_timeout_s: float = 300,
                **extra: str) -> dict[str, str]:
    """An environment with its own AIRFLOW_HOME under ``home`` (migrated here) and MXPIPE_HOME
    ``home``; ``extra`` variables added last."""
    home = str(home)
    env = {**os.environ, "MXPIPE_HOME": home, "AIRFLOW_HOME": os.path.join(home, "airflow"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": dags_folder,
           "PYTHONPATH": REPO, "MXPIPE_SCHEDULE": "none", "MXPIPE_RETRY_DELAY_S": "1", **extra}
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"], env=env,
                   check=True, capture_output=True, timeout=migrate_timeout_s)
    return env


def dag_tests(env: dict[str, str], confs: list[dict[str, Any] | None], *, dag_id: str = "mxnet_training",
              xcom_tasks: tuple[str, ...] = (), timeout: float = 900) -> tuple[dict[str, Any], str]:
    """Run ``dag.test(run_conf=c)`` of ``dag_id`` for each conf in order, in one child process:
    ``({"results": [...], "dag_runs": n, "dag": {...}}, its output)``; an ``AssertionError`` with the
    output's tail when the child printed no result."""
    out = subprocess.run([sys.executable, "-c", RUNNER, env.get("AIRFLOW__CORE__DAGS_FOLDER", DAGS), dag_id,
                          json.dumps(confs), json.dumps(list(xcom_tasks))],
                         env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DAGRUN_RESULTS ")]
    assert lines, f"no result (rc={out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("DAGRUN_RESULTS "):]), out.stdout + out.stderr


def tasks(result: dict[str, Any], *, unmapped_only: bool) -> dict[str, dict[str, Any]]:
    """A run's tasks by id: ``{"state", "try_number"}``; a mapped task's entry is its last
    instance's unless ``unmapped_only`` (then mapped instances are left out)."""
    return {ti["task_id"]: {"state": ti["state"], "try_number": ti["try_number"]}
            for ti in result["task_instances"] if not (unmapped_only and ti["map_index"] >= 0)}


def run_confs(env: dict[str, str], confs: list[dict[str, Any]], timeout: float = 900) -> tuple[dict[str, Any], str]:
    """``dag_tests`` of the training DAG, each finished run's tasks by id (unmapped ones) under
    ``"tasks"``."""
    report, logs = dag_tests(env, confs, timeout=timeout)
    for result in report["results"]:
        if "rejected" not in result:
            result["tasks"] = tasks(result, unmapped_only=True)
    return report, logs


def run_dag(env: dict[str, str], conf: dict[str, Any] | None, *, timeout: float = 900,
            dag_id: str = "mxnet_training", xcom_tasks: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """One ``dag.test()`` run that must not be refused: its result (``"tasks"``: every task
    instance, a mapped task's last one standing for it) and the output."""
    report, logs = dag_tests(env, [conf], dag_id=dag_id, xcom_tasks=xcom_tasks, timeout=timeout)
    (result,) = report["results"]
    if "rejected" in result:
        raise RuntimeError(f"the run was refused: {result['rejected']}: {result['message']}\n{logs[-4000:]}")
    return result | {"tasks": tasks(result, unmapped_only=False), "dag": report["dag"]}, logs
