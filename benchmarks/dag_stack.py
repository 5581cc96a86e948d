"""The real training DAG against a stack of its own, for benchmarks that measure whole runs.

``local_stack`` starts a SeaweedFS S3 server and an MLflow server on free ports under a folder
(``benchmarks/dag_services.py``), migrates an Airflow database there and yields the environment a run needs; ``run_dag`` runs the
``mxnet_training`` DAG in a child process with ``dag.test()`` (Airflow's own task runner and
retries, the local cluster backend) and returns the run's state, run id and task tries.
``benchmarks/recovery.py`` (P4) and ``benchmarks/goodput.py`` (G1) both run on it.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.dag_services import embedded_services

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNNER = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(sys.argv[1])
dag = bag.dags["mxnet_training"]
dr = dag.test(run_conf=json.loads(sys.argv[2]))
tis = {ti.task_id: {"state": str(ti.state), "try_number": ti.try_number} for ti in dr.get_task_instances()}
print("DAGRUN_RESULT " + json.dumps({"state": str(dr.state), "run_id": dr.run_id, "tasks": tis}))
"""

DIGITS = ("import sys, pandas as pd; from sklearn.datasets import load_digits; from common import storage; "
          "d = load_digits(); f = pd.DataFrame(d.data, columns=[f'pixel_{i}' for i in range(64)]); "
          "f['label'] = d.target; storage.put_bytes(sys.argv[1], f.to_csv(index=False).encode())")


@contextlib.contextmanager
def local_stack(root: Path, *, artifact_prefix: str, retry_delay_s: float) -> Iterator[tuple[dict[str, str], str]]:
    """S3 + MLflow (``embedded_services``) and an Airflow database under ``root``; yields the
    environment of a DAG run and the bucket."""
    with embedded_services(root) as (cfg, services):
        env = {**os.environ, **services}
        env.update({"MXPIPE_HOME": str(root / "home"), "AIRFLOW_HOME": str(root / "airflow"),
                    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                    "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(REPO, "dags"), "PYTHONPATH": REPO,
                    "MXPIPE_ARTIFACT_ROOT": f"s3://{cfg.bucket}/{artifact_prefix}", "MXPIPE_SCHEDULE": "none",
                    "MXPIPE_RETRY_DELAY_S": str(retry_delay_s)})
        env.pop("AWS_ENDPOINT_URL", None)
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"], env=env,
                       check=True, capture_output=True, timeout=600)
        yield env, cfg.bucket


def run_dag(env: dict[str, str], conf: dict[str, Any], *, timeout_s: float, log: Path | None = None) -> dict[str, Any]:
    """One ``dag.test()`` run of the training DAG (its output also to ``log``); raises with the
    output's tail if it did not finish."""
    out = subprocess.run([sys.executable, "-c", RUNNER, os.path.join(REPO, "dags"), json.dumps(conf)], env=env,
                         capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DAGRUN_RESULT ")]
    if not lines:
        raise RuntimeError(f"run failed (rc={out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def upload(env: dict[str, str], uri: str, code: str = DIGITS, *args: str) -> None:
    """Run ``code`` (a snippet that writes the dataset to ``sys.argv[1]``) with the stack's S3."""
    subprocess.run([sys.executable, "-c", code, uri, *args], env=env, check=True, timeout=900, cwd=REPO)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The supervisor's event log (``MXPIPE_EVENTS_FILE``), one dict per line."""
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
