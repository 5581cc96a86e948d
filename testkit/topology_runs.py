"""The training DAG run through the namespace topology (``infra.topology``) over the REST API,
and the proof that ``down`` left nothing: no namespace, no uplink, no process of the topology.

``python -m testkit.topology_runs --root R [--backend hosts]`` runs one DAG run on a topology
that is up and prints its task states (by hand, beside ``python -m infra.topology up``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import storage
from infra import netns
from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag, wait_for_dag_run
from infra.topology import TopologySettings, client_env

DAG_ID = "mxnet_training"


def run_training_dag(root: Path, csv: bytes, *, backend: str = "hosts", timeout_s: float = 900.0) -> dict[str, Any]:
    """Put ``csv`` in the topology's S3, trigger the training DAG on it (debug recipe, two
    workers, one server on ``backend``), wait for the end; the run's state, task states,
    seconds, and the ``register`` task's result."""
    env = client_env(root)
    # The S3 client of common.storage reads the standard AWS variables: this process is a client
    # of the topology's S3 on this machine, as a person's shell would be.
    os.environ.update({"AWS_ENDPOINT_URL_S3": env["s3_endpoint"], "AWS_ACCESS_KEY_ID": env["access_key"],
                       "AWS_SECRET_ACCESS_KEY": env["secret_key"], "AWS_DEFAULT_REGION": "us-east-1"})
    uri = f"s3://{env['bucket']}/topology-test/digits.csv"
    storage.put_bytes(uri, csv)
    wait_for_dag(env["airflow_url"], DAG_ID, timeout_s=300, dag_file="mxnet_training.py")
    conf = {"dataset_uri": uri, "recipe": "debug", "registered_model_name": "digits-topology",
            "backend": backend, "num_workers": 2, "num_servers": 1}
    t0 = time.monotonic()
    run_id = trigger_dag_run(env["airflow_url"], DAG_ID, conf)
    state = wait_for_dag_run(env["airflow_url"], DAG_ID, run_id, timeout_s=timeout_s, poll_s=5)
    seconds = time.monotonic() - t0
    with AirflowClient(env["airflow_url"]) as client:
        states = client.task_states(DAG_ID, run_id)
        registered = None
        if state == "success":
            path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/register/xcomEntries/return_value"
            registered = client.request("GET", path, params={"deserialize": "true"}).json()["value"]
        hosts = {ti["task_id"]: ti.get("hostname") for ti in client.task_instances(DAG_ID, run_id)}
        # The train task's log as the UI shows it: the API server (on its own host) reads it from
        # the log server of the worker that ran it, named by its address (hostname_callable).
        log = client.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/logs/1",
                             params={"full_content": "true"}).json()
    train_log = json.dumps(log.get("content", ""))
    return {"run_id": run_id, "state": state, "states": states, "seconds": round(seconds, 1),
            "registered": registered, "hostnames": hosts, "train_log_chars": len(train_log),
            "train_log_names_the_job": "started training job" in train_log}


def missing_tools() -> str:
    """Why the topology cannot come up on this machine ("" if it can): root, Debian packages."""
    import shutil

    if os.geteuid() != 0:
        return "needs root (ip netns)"
    tools = {"redis-server": "redis-server", "sshd": "openssh-server", "setpriv": "util-linux"}
    missing = [pkg for tool, pkg in tools.items() if not shutil.which(tool, path=netns.SBIN_PATH)]
    if not (shutil.which("initdb") or list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))):
        missing.append("postgresql")
    return f"missing Debian packages {missing} (scripts/bootstrap.sh installs them)" if missing else ""


def leftovers(settings: TopologySettings) -> dict[str, Any]:
    """What of the topology is still on this machine: its namespaces, its uplink, and every
    process whose environment carries its tag (``MXPIPE_TOPOLOGY``), wherever it runs."""
    import psutil

    tagged = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("MXPIPE_TOPOLOGY") == settings.prefix:
                tagged.append((proc.pid, " ".join(proc.info["cmdline"] or [])[:120]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return {"namespaces": netns.namespaces(f"{settings.prefix}-"), "uplink": netns.link_exists(settings.uplink),
            "processes": tagged}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--backend", default="hosts", choices=("hosts", "local"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from testkit.digits import digits_csv

    result = run_training_dag(Path(args.root), digits_csv(), backend=args.backend)
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["state"] == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
