"""The training DAG run through the namespace topology (``infra.topology``) over the REST API,
and the proof that ``down`` left nothing: no namespace, no uplink, no process of the topology.

``cross_worker_release`` provisions a cluster from one Celery worker's host and reaps it (its
supervisor stopped over ssh) from the other's; ``worker_files`` lists what of clusters and jobs
each worker's home holds (nothing: they live in S3); ``cross_host_reads`` has one worker read a
file the other wrote into its home (it cannot: each host sees its own home only).

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


def use_topology_s3(root: Path) -> dict[str, Any]:
    """This process a client of the topology's S3 on this machine, as a person's shell would be
    (common.storage's S3 client reads the AWS variables); ``client_env``'s URLs and key pair."""
    from infra.topology import s3_env, secrets

    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    os.environ.update(s3_env(settings, secrets(root)))
    return client_env(root)


def run_training_dag(root: Path, csv: bytes, *, backend: str = "hosts", timeout_s: float = 900.0,
                     key: str = "topology-test/digits.csv", conf: dict[str, Any] | None = None) -> dict[str, Any]:
    """Put ``csv`` in the topology's S3 under ``key``, trigger the training DAG on it (debug
    recipe, two workers, one server on ``backend``; ``conf`` over that), wait for the end; the
    run's state, task states, seconds, and the ``register`` task's result."""
    env = use_topology_s3(root)
    uri = f"s3://{env['bucket']}/{key}"
    storage.put_bytes(uri, csv)
    wait_for_dag(env["airflow_url"], DAG_ID, timeout_s=300, dag_file="mxnet_training.py")
    conf = {"dataset_uri": uri, "recipe": "debug", "registered_model_name": "digits-topology",
            "backend": backend, "num_workers": 2, "num_servers": 1, **(conf or {})}
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
    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    # The workers whose parts the train task's log holds (its first part, before it deferred,
    # and the part after the trigger fired), named by their addresses in the log's sources.
    train_workers = sorted(w for w in ("worker1", "worker2") if settings.address(w) in train_log)
    return {"run_id": run_id, "state": state, "states": states, "seconds": round(seconds, 1),
            "registered": registered, "hostnames": hosts, "train_log_chars": len(train_log),
            "train_log_names_the_job": "started training job" in train_log, "train_log_workers": train_workers}


# Run in a Celery worker's namespace with its environment: provision a hosts cluster whose TTL
# runs out at once and start, through it, a stand-in for the job's supervisor on the first
# training host (over ssh), which lives until something stops it.
_PROVISION_ON_WORKER = """
import json, sys
from infra import hosts_cluster
from infra.cluster import ClusterSpec, provision
from infra.cluster_settings import cluster_options
hosts_cluster.supervise_argv = lambda python, *_: [python, "-c", "import time; time.sleep(600)"]
spec = ClusterSpec(run_tag=sys.argv[1], workers=1, servers=1, backend="hosts", ttl_s=1.0,
                   options=cluster_options("hosts"))
cluster = provision(spec)
cluster.start_supervisor("s3://unused/job.json", job_id="stand-in", attempt=1, env={})
print(json.dumps({"cluster_id": cluster.cluster_id, "record": cluster.record_uri}))
"""


def _on_worker(root: Path, worker: str, argv: list[str], timeout_s: float = 180.0) -> str:
    """``argv`` (after the interpreter) as a process of ``worker`` (``infra.topology.host_command``:
    its namespaces, so it sees its own home only), with its Airflow host's environment and S3 as
    its tasks get it (the aws_default connection's key pair)."""
    import subprocess

    from infra.topology import airflow_host_env, host_command, s3_env, secrets

    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    creds = secrets(root)
    env = {**airflow_host_env(root, settings, creds, worker), **s3_env(settings, creds)}
    out = subprocess.run(host_command(root, settings, worker, [sys.executable, *argv]), env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{worker}: {argv[:2]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout


def _stand_ins(cluster_id: str) -> list[int]:
    """Pids of the stand-in supervisor of ``cluster_id`` (on a training host: the namespaces
    share this machine's process table)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("MXPIPE_CLUSTER") == cluster_id and "time.sleep(600)" in " ".join(
                    proc.info["cmdline"] or []):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def cross_worker_release(root: Path, *, wait_s: float = 30.0) -> dict[str, Any]:
    """A cluster provisioned, and its supervisor started, by ``worker1``; found, reaped (its
    supervisor stopped over ssh) by ``worker2``'s reaper; and nothing of it left for either.
    What each step saw, and the seconds it took."""
    import uuid

    tag = f"mxnet_training--cross-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    made = json.loads(_on_worker(root, "worker1", ["-c", _PROVISION_ON_WORKER, tag]).splitlines()[-1])
    cid = made["cluster_id"]
    provisioned_s = time.monotonic() - t0
    # The start returns before the stand-in runs (and records itself): bounded wait for it.
    deadline = time.monotonic() + wait_s
    while not _stand_ins(cid) and time.monotonic() < deadline:
        time.sleep(0.5)
    running = bool(_stand_ins(cid))
    time.sleep(1.5)  # its TTL (1 s) runs out
    seen_by_worker2 = [json.loads(line)["cluster_id"] for line in
                       _on_worker(root, "worker2", ["-m", "infra.cluster", "leaked"]).splitlines() if line.strip()]
    t1 = time.monotonic()
    reaped = json.loads(_on_worker(root, "worker2", ["-m", "infra.cluster", "reap"]).splitlines()[-1])["reaped"]
    reap_s = time.monotonic() - t1
    deadline = time.monotonic() + wait_s
    while _stand_ins(cid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left_on_worker1 = [json.loads(line)["cluster_id"] for line in
                       _on_worker(root, "worker1", ["-m", "infra.cluster", "leaked"]).splitlines() if line.strip()]
    return {"cluster_id": cid, "record": made["record"], "supervisor_started": running,
            "seen_by_worker2": cid in seen_by_worker2, "reaped_by_worker2": cid in reaped,
            "supervisor_left": _stand_ins(cid), "record_left": storage.exists(made["record"]),
            "seen_by_worker1_after": cid in left_on_worker1, "provision_s": round(provisioned_s, 1),
            "reap_s": round(reap_s, 1)}


# Run as a process of a host: what it finds at each path, read for real ("ok: <text>", or the
# error's name), as JSON.
_READ_ON_HOST = """
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        out[path] = "listed: " + " ".join(sorted(os.listdir(path))) if os.path.isdir(path) else \\
            "ok: " + open(path).read()
    except OSError as exc:
        out[path] = type(exc).__name__
print(json.dumps(out))
"""


def cross_host_reads(root: Path) -> dict[str, Any]:
    """A file ``worker2`` writes into its own home, read back there, and read from ``worker1``
    (at the same path: every host sees its own home where it is); what ``worker1`` finds of the
    homes folder and of this machine's records of ``worker2``'s servers. A host of its own file
    system: the reads from ``worker1`` fail, and it lists its own home alone."""
    import uuid

    from infra.topology import host_home, host_records

    probe = host_home(root, "worker2") / f"probe-{uuid.uuid4().hex[:8]}.txt"
    written = _on_worker(root, "worker2", ["-c", f"open({str(probe)!r}, 'w').write('worker2 wrote this')"])
    own = json.loads(_on_worker(root, "worker2", ["-c", _READ_ON_HOST, str(probe)]))[str(probe)]
    # A temporary file (tempfile, as libraries make them) lands in the host's own home too.
    temp = _on_worker(root, "worker2", ["-c", "import tempfile\nwith tempfile.NamedTemporaryFile(delete=False) as f:"
                                               "\n    f.write(b'worker2 wrote this')\nprint(f.name)"]).strip()
    record = host_records(root, "worker2") / "logs" / "airflow-celery-worker.log"
    paths = [str(probe), str(host_home(root, "worker2")), str(root / "hosts"), str(record), temp]
    other = json.loads(_on_worker(root, "worker1", ["-c", _READ_ON_HOST, *paths]))
    return {"written": written == "" and probe.exists(), "read_on_worker2": own,
            "worker1_reads_worker2_file": other[str(probe)], "worker1_lists_worker2_home": other[paths[1]],
            "worker1_lists_homes": other[paths[2]], "worker1_reads_worker2_records": other[paths[3]],
            "record_exists": record.exists(), "worker2_temp_file": temp,
            "temp_in_own_home": Path(temp).is_relative_to(host_home(root, "worker2")),
            "worker1_reads_worker2_temp_file": other[temp]}


def worker_files(root: Path) -> dict[str, list[str]]:
    """Files of clusters and jobs on each Celery worker's disk (none should be: they live in S3)."""
    from infra.topology import WORKERS, host_home

    out = {}
    for worker in WORKERS:
        home = host_home(root, worker) / "mxpipe"
        out[worker] = sorted(str(p.relative_to(home)) for sub in ("clusters", "jobs") for p in (home / sub).rglob("*")
                             if p.is_file())
    return out


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
