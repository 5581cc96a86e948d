"""P4: recovery time, from ``kill -9`` of a worker to the first training step after the resume.

Runs the real DAG with ``dag.test()`` (Airflow's task runner, the deferrable train operator
with its trigger run inline, its retry with ``MXPIPE_RETRY_DELAY_S``, the local cluster backend,
the job's detached supervisor) against a SeaweedFS S3 server and an MLflow server started here,
with worker 1 killing itself (SIGKILL) at a chosen step, and takes the timeline from:

- the fault's once-file, created by the worker an instant before it kills itself (kill time);
- the supervisor's event log (``MXPIPE_EVENTS_FILE``): the failure it detected, the roles it
  stopped, each attempt's start, and every role line with the time it arrived;
- the worker lines of the retry: ``started (kvstore=…)`` (ps-lite rendezvous done),
  ``resumed from step R``, and ``checkpoint committed: step R+1`` (the run checkpoints every
  step, so the first step after resume shows up as its checkpoint; that term includes one
  small checkpoint write).

Terms: detect (kill → failure seen), teardown (→ every role of the attempt stopped), retry
(→ the next attempt's job start: the train operator's trigger seeing the ``failed`` status record
(one read every ``POLL_S`` = 10 s, so up to 10 s), Airflow's retry delay, the task restart
writing the next job document, and the new detached supervisor's start), cluster start
(→ ps-lite rendezvous of the new roles, which import mxnet), restore (→ shards fetched, model
built, checkpoint verified and loaded), first step (→ the first step's checkpoint committed).

    .venv/bin/python benchmarks/recovery.py [--runs N] [--retry-delay-s S] [--kill-step K]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.dag_services import embedded_services  # noqa: E402
from benchmarks.result_file import write_json  # noqa: E402

RUNNER = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(sys.argv[1])
dag = bag.dags["mxnet_training"]
dr = dag.test(run_conf=json.loads(sys.argv[2]))
tis = {ti.task_id: {"state": str(ti.state), "try_number": ti.try_number} for ti in dr.get_task_instances()}
print("DAGRUN_RESULT " + json.dumps({"state": str(dr.state), "tasks": tis}))
"""
TERMS = ("detect", "teardown", "retry", "cluster_start", "restore", "first_step", "total")


def _first(events: list[dict], pred, after: float) -> dict:
    for ev in events:
        if ev["t"] >= after and pred(ev):
            return ev
    raise RuntimeError("event not found after %.3f" % after)


def timeline(events: list[dict], kill_t: float) -> dict[str, float]:
    failed = _first(events, lambda e: e["event"] == "role_failed", kill_t)
    stopped = _first(events, lambda e: e["event"] == "roles_stopped", failed["t"])
    start2 = _first(events, lambda e: e["event"] == "job_start", stopped["t"])
    joined = _first(events, lambda e: e["event"] == "line" and e["role"] == "worker-0"
                    and "started (kvstore=" in e["text"], start2["t"])
    resumed = _first(events, lambda e: e["event"] == "line" and "resumed from step" in e["text"], joined["t"])
    step = int(resumed["text"].split("resumed from step ")[1].split()[0])
    first = _first(events, lambda e: e["event"] == "line" and f"checkpoint committed: step {step + 1} " in e["text"],
                   resumed["t"])
    marks = [kill_t, failed["t"], stopped["t"], start2["t"], joined["t"], resumed["t"], first["t"]]
    out = {name: marks[i + 1] - marks[i] for i, name in enumerate(TERMS[:-1])}
    out["total"] = first["t"] - kill_t
    out["resumed_from_step"] = step
    return out


def run_once(env: dict[str, str], dataset: str, kill_step: int, workdir: Path) -> dict[str, float]:
    events, once = workdir / "events.jsonl", workdir / "fault-fired"
    conf = {"dataset_uri": dataset, "recipe": "debug", "epochs": 3, "batch_size": 32, "learning_rate": 0.005,
            "num_workers": 2, "num_servers": 1, "checkpoint_every_n_steps": 1,
            "registered_model_name": "digits-recovery-bench"}
    run_env = {**env, "MXPIPE_EVENTS_FILE": str(events), "MXPIPE_FAULT_KILL_STEP": str(kill_step),
               "MXPIPE_FAULT_KILL_RANK": "1", "MXPIPE_FAULT_ONCE_FILE": str(once)}
    out = subprocess.run([sys.executable, "-c", RUNNER, os.path.join(REPO, "dags"), json.dumps(conf)], env=run_env,
                         capture_output=True, text=True, timeout=1200, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DAGRUN_RESULT ")]
    if not lines or not once.exists():
        raise RuntimeError(f"run failed (rc={out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1].split(" ", 1)[1])
    if result["tasks"]["train"]["try_number"] != 2:
        raise RuntimeError(f"expected train to succeed on its 2nd try: {result}")
    evs = [json.loads(ln) for ln in events.read_text().splitlines()]
    return timeline(evs, once.stat().st_mtime)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--retry-delay-s", type=float, default=1.0)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--json", help="also write the medians and maxima to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mxpipe-p4-") as tmp:
        root = Path(tmp)
        with embedded_services(root) as (cfg, services):
            env = {**os.environ, **services}
            env.update({"MXPIPE_HOME": str(root / "home"), "AIRFLOW_HOME": str(root / "airflow"),
                        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                        "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(REPO, "dags"), "PYTHONPATH": REPO,
                        "MXPIPE_ARTIFACT_ROOT": f"s3://{cfg.bucket}/p4", "MXPIPE_SCHEDULE": "none",
                        "MXPIPE_RETRY_DELAY_S": str(args.retry_delay_s)})
            env.pop("AWS_ENDPOINT_URL", None)
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"], env=env,
                           check=True, capture_output=True, timeout=600)
            dataset = f"s3://{cfg.bucket}/datasets/digits.csv"
            upload_digits(env, dataset)
            samples = []
            for i in range(args.runs):
                work = root / f"run-{i}"
                work.mkdir()
                samples.append(run_once(env, dataset, args.kill_step, work))
                print(json.dumps({k: round(v, 2) for k, v in samples[-1].items()}), flush=True)
    print(f"\nP4 recovery, {args.runs} runs, retry delay {args.retry_delay_s:g} s (median / max, seconds)")
    summary: dict[str, float] = {"runs": args.runs, "retry_delay_s": args.retry_delay_s}
    for term in TERMS:
        values = [s[term] for s in samples]
        print(f"  {term:<14} {statistics.median(values):6.2f} {max(values):6.2f}")
        summary[f"{term}_median_s"], summary[f"{term}_max_s"] = statistics.median(values), max(values)
    write_json(args.json, summary)
    return 0


def upload_digits(env: dict[str, str], uri: str) -> None:
    code = ("import sys, pandas as pd; from sklearn.datasets import load_digits; from common import storage; "
            "d = load_digits(); f = pd.DataFrame(d.data, columns=[f'pixel_{i}' for i in range(64)]); "
            "f['label'] = d.target; storage.put_bytes(sys.argv[1], f.to_csv(index=False).encode())")
    subprocess.run([sys.executable, "-c", code, uri], env=env, check=True, timeout=300, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
