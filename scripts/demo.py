"""The main job, end to end, on the embedded stack (``make demo``).

Starts SeaweedFS (S3), MLflow and Airflow 3 under ``.local/`` (or reuses them), uploads the
demo dataset (scikit-learn's ``load_digits``: 1,797 8x8 handwritten digits, UCI) to S3 as a CSV
table with a ``label`` column, triggers the ``mxnet_training`` DAG through Airflow's REST API,
follows it to the end and prints what it produced. Services keep running afterwards (the UIs
stay browsable); ``make down`` stops them.

    .venv/bin/python scripts/demo.py [--conf '{"epochs": 30}'] [--timeout 1200]
"""
from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.cli import parser as cli_parser  # noqa: E402
from infra import airflow_client, services  # noqa: E402
from infra.stack_config import StackConfig, mxpipe_home, stack_env  # noqa: E402

DAG_ID = "mxnet_training"
DATASET_KEY = "datasets/digits/digits.csv"
EXAMPLES = """
.venv/bin/python scripts/demo.py                                   # what make demo runs
.venv/bin/python scripts/demo.py --conf '{"epochs": 30, "num_workers": 3}' --timeout 1200
"""


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def upload_digits(bucket: str) -> str:
    """Write digits as a CSV table to S3 (idempotent: same bytes, same key)."""
    import pandas as pd
    from sklearn.datasets import load_digits

    from common import storage

    digits = load_digits()
    frame = pd.DataFrame(digits.data, columns=[f"pixel_{i}" for i in range(digits.data.shape[1])])
    frame["label"] = digits.target
    uri = f"s3://{bucket}/{DATASET_KEY}"
    storage.put_bytes(uri, frame.to_csv(index=False).encode())
    _say(f"dataset: {len(frame)} rows x {frame.shape[1] - 1} features uploaded to {uri}")
    return uri


def main() -> int:
    parser = cli_parser("The main job, end to end, on the embedded stack: start S3, MLflow and Airflow under .local/ "
                        "(or reuse them), upload the digits dataset, trigger the mxnet_training DAG, follow it and "
                        "print the run state, MLflow run, registered model and test accuracy.", EXAMPLES,
                        prog="scripts/demo.py")
    parser.add_argument("--conf", default="{}", help="JSON of DAG params to override")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the run")
    args = parser.parse_args()
    started = time.monotonic()

    home = mxpipe_home()
    cfg = StackConfig.load(home)
    _say(f"starting the embedded stack under {home}")
    services.up(cfg, echo=_say)
    os.environ.update(stack_env(home))

    dataset = upload_digits(cfg.bucket)
    airflow_client.wait_for_dag(cfg.airflow_url, DAG_ID, timeout_s=300, dag_file="mxnet_training.py")
    conf = {"dataset_uri": dataset, **json.loads(args.conf)}
    run_id = airflow_client.trigger_dag_run(cfg.airflow_url, DAG_ID, conf)
    _say(f"triggered {DAG_ID} run {run_id}; Airflow UI: {cfg.airflow_url}/dags/{DAG_ID}")

    def progress(states: dict) -> None:
        _say("tasks: " + ", ".join(f"{k}={v or 'none'}" for k, v in states.items()))

    state = airflow_client.wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=args.timeout,
                                            poll_s=3.0, on_progress=progress)
    elapsed = time.monotonic() - started
    print()
    print(f"Airflow run:        {run_id}: {state.upper()} ({elapsed:.0f}s from start of the demo)")
    if state != "success":
        print(f"Task logs:          {cfg.airflow_url}/dags/{DAG_ID}/runs/{run_id}")
        return 1
    with airflow_client.AirflowClient(cfg.airflow_url) as client:
        def xcom(task_id: str) -> dict:
            path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
            value = client.request("GET", path, params={"deserialize": "true"}).json()["value"]
            return json.loads(value) if isinstance(value, str) else value

        reused = client.task_states(DAG_ID, run_id).get("reuse") == "success"
        if reused:  # an earlier run trained on the same inputs: nothing was provisioned or trained
            out = xcom("reuse")
            print(f"Reused model:       {out['registered_model_name']} version {out['version']}, trained by run "
                  f"{out['reused_from']['run_id']} on the same inputs (trigger with force=true to train again)")
            print(f"MLflow run:         {out['run_url']} (this run's record of the reuse: {out['reuse_run_url']})")
            return 0
        registered, trained = xcom("register"), xcom("train")
    print(f"MLflow run:         {registered['run_url']}")
    print(f"Registered model:   {registered['registered_model_name']} version {registered['version']} "
          f"(alias challenger)")
    print(f"Test accuracy:      {registered['test_accuracy']:.4f}")
    print(f"S3 checkpoints:     {trained['checkpoint_prefix']}")
    print(f"Model files:        {trained['model_prefix']}")
    print("Services keep running; stop them with: make down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
