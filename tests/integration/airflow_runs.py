"""Whole ``dag.test()`` runs of the training DAG in one subprocess with its own AIRFLOW_HOME.

Several confs run in the same subprocess (Airflow's import costs seconds here); each conf's
outcome is either the finished run (state, tasks with try numbers) or the exception that
refused it, with its message, so a test can check both a rejected trigger and a failed run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUNNER = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.models.dagrun import DagRun
from airflow.utils.session import create_session
bag = DagBag(sys.argv[1])
assert not bag.import_errors, bag.import_errors
dag = bag.dags["mxnet_training"]
results = []
for conf in json.loads(sys.argv[2]):
    try:
        dr = dag.test(run_conf=conf)
    except Exception as exc:  # a refused trigger: the message is what the user sees
        results.append({"rejected": type(exc).__name__, "message": str(exc)})
        continue
    tis = {ti.task_id: {"state": str(ti.state), "try_number": ti.try_number} for ti in dr.get_task_instances()
           if ti.map_index < 0}
    results.append({"state": str(dr.state), "run_id": dr.run_id, "tasks": tis})
with create_session() as session:
    runs = session.query(DagRun).filter(DagRun.dag_id == "mxnet_training").count()
print("DAGRUN_RESULTS " + json.dumps({"results": results, "dag_runs": runs}))
"""


def airflow_env(home: str, **extra: str) -> dict[str, str]:
    """An environment with its own AIRFLOW_HOME (a migrated SQLite DB) and MXPIPE_HOME."""
    env = {**os.environ, "MXPIPE_HOME": home, "AIRFLOW_HOME": os.path.join(home, "airflow"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(REPO, "dags"),
           "PYTHONPATH": REPO, "MXPIPE_SCHEDULE": "none", "MXPIPE_RETRY_DELAY_S": "1", **extra}
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"], env=env,
                   check=True, capture_output=True, timeout=300)
    return env


def run_confs(env: dict[str, str], confs: list[dict[str, Any]], timeout: float = 900) -> tuple[dict[str, Any], str]:
    """Run ``dag.test(run_conf=c)`` for each conf in order; the outcomes and the combined log."""
    out = subprocess.run([sys.executable, "-c", RUNNER, os.path.join(REPO, "dags"), json.dumps(confs)],
                         env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DAGRUN_RESULTS ")]
    assert lines, f"no result (rc={out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("DAGRUN_RESULTS "):]), out.stdout + out.stderr
