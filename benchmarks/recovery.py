"""P4: recovery time, from ``kill -9`` of a worker to the first training step after the resume.

Runs the real DAG with ``dag.test()`` (Airflow's task runner, the deferrable train operator
with its trigger run inline, the local cluster backend, the job's detached supervisor, which
restarts the roles in place: ``training.launch.restarts``; with ``--no-restart`` the job's
``cluster.max_restarts_without_progress`` is 0 and the train task's Airflow retry, with
``MXPIPE_RETRY_DELAY_S``, recovers instead) against a SeaweedFS S3 server and an MLflow server started here,
with worker 1 killing itself (SIGKILL) at a chosen step, and takes the timeline from:

- the fault's once-file, created by the worker an instant before it kills itself (kill time);
- the supervisor's event log (``MXPIPE_EVENTS_FILE``): the failure it detected, the roles it
  stopped, each attempt's start, and every role line with the time it arrived;
- the worker lines of the retry: ``started (kvstore=…)`` (ps-lite rendezvous done),
  ``resumed from step R``, and ``checkpoint committed: step R+1`` (the run checkpoints every
  step, so the first step after resume shows up as its checkpoint; that term includes one
  small checkpoint write).

Terms: detect (kill → failure seen), teardown (→ every role of the attempt stopped), retry
(→ the next round's start: at once for a restart in place; with ``--no-restart`` the train
operator's trigger seeing the ``failed`` status record (one read every ``MXPIPE_TRAIN_POLL_S``,
2 s by default, so up to that), Airflow's retry delay, the task restart writing the next job
document, and the new detached supervisor's start), cluster start
(→ ps-lite rendezvous of the new roles, which import mxnet), restore (→ shards fetched, model
built, checkpoint verified and loaded), first step (→ the first step's checkpoint committed).

    .venv/bin/python benchmarks/recovery.py [--runs N] [--retry-delay-s S] [--kill-step K] [--no-restart]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.dag_stack import local_stack, read_events, run_dag, upload  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.timeline import TERMS, Pred, failure_timeline, role_event  # noqa: E402
from common.events import CheckpointCommitted  # noqa: E402


def committed_first_step(resumed: int) -> Pred:
    """P4's first-step mark: the checkpoint of step ``resumed + 1`` committed (it checkpoints every step)."""
    return role_event(CheckpointCommitted, step=resumed + 1)


def run_once(env: dict[str, str], dataset: str, kill_step: int, workdir: Path, *,
             in_place: bool) -> dict[str, float]:
    events, once = workdir / "events.jsonl", workdir / "fault-fired"
    conf = {"dataset_uri": dataset, "recipe": "debug", "epochs": 3, "batch_size": 32, "learning_rate": 0.005,
            "num_workers": 2, "num_servers": 1, "checkpoint_every_n_steps": 1,
            "registered_model_name": "digits-recovery-bench", "force": True}  # every round trains
    if not in_place:
        conf["config"] = {"cluster": {"max_restarts_without_progress": 0}}
    run_env = {**env, "MXPIPE_EVENTS_FILE": str(events), "MXPIPE_FAULT_KILL_STEP": str(kill_step),
               "MXPIPE_FAULT_KILL_RANK": "1", "MXPIPE_FAULT_ONCE_FILE": str(once)}
    result = run_dag(run_env, conf, timeout_s=1200)
    if not once.exists():
        raise RuntimeError(f"the fault did not fire: {result}")
    expected_try = 1 if in_place else 2
    if result["tasks"]["train"]["try_number"] != expected_try:
        raise RuntimeError(f"expected train to succeed on try {expected_try}: {result}")
    timeline = failure_timeline(read_events(events), once.stat().st_mtime, first_step=committed_first_step)
    return {k: v for k, v in timeline.items() if k in TERMS or k == "resumed_from_step"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--retry-delay-s", type=float, default=1.0)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--no-restart", action="store_true",
                        help="no restart in place: the Airflow retry recovers (the fallback's cost)")
    parser.add_argument("--json", help="also write the medians and maxima to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mxpipe-p4-") as tmp:
        root = Path(tmp)
        with local_stack(root, artifact_prefix="p4", retry_delay_s=args.retry_delay_s) as (env, bucket):
            dataset = f"s3://{bucket}/datasets/digits.csv"
            upload(env, dataset)
            samples = []
            for i in range(args.runs):
                work = root / f"run-{i}"
                work.mkdir()
                samples.append(run_once(env, dataset, args.kill_step, work, in_place=not args.no_restart))
                print(json.dumps({k: round(v, 2) for k, v in samples[-1].items()}), flush=True)
    how = "Airflow retry" if args.no_restart else "restart in place"
    print(f"\nP4 recovery by {how}, {args.runs} runs, retry delay {args.retry_delay_s:g} s (median / max, seconds)")
    summary: dict[str, float | str] = {"runs": args.runs, "retry_delay_s": args.retry_delay_s, "recovery": how}
    for term in TERMS:
        values = [s[term] for s in samples]
        print(f"  {term:<14} {statistics.median(values):6.2f} {max(values):6.2f}")
        summary[f"{term}_median_s"], summary[f"{term}_max_s"] = statistics.median(values), max(values)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
