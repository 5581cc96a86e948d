"""A job of many roles at a size the suite can afford: 6 workers and 3 servers (10 processes with
the scheduler, on a machine of 2 cores), ``dist_sync``, on the local backend under a detached
supervisor, with its data and checkpoints on S3. One worker is killed at a step; the supervisor
restarts every role in place and the job ends with every step trained once. One job, not two:
each round of 10 roles costs the suite about 15 s of start.

The same path as ``benchmarks/many_roles.py`` at 32+ roles; here it checks what a wrong count
would break at any size: every role of both rounds started and joined (six distinct kvstore
ranks of six workers each round), the first step of the fresh start and of the resume are marked
(``common.events.FirstStep``, ``FirstStepAfterResume``: what the benchmark measures time to),
the failure is seen and timed from the supervisor's event log.

ps-lite connects every role to every other one, so a role's file descriptors grow with the job
(``common.procs.limits``): the job runs under a soft limit of open files too low for its size
(32: the scheduler holds about 3.3 per role, so about 35 here; what 1024 is to a job of about 300
roles), which every role raises to its hard limit (without that, the scheduler fails with EMFILE
and the rendezvous never ends: the job fails as "did not start").
"""
import json
import stat
import sys

import pytest

from common import storage
from common.events import FirstStep, FirstStepAfterResume, WorkerStarted
from testkit.dag_stack import read_events
from testkit.local_jobs import make_job, run_local, shard_digits
from testkit.timeline import LEAD, attempts, failure_timeline, role_event_of
from training.launch.status import read_status

pytestmark = pytest.mark.integration

WORKERS, SERVERS = 6, 3
LOW_SOFT_LIMIT = 32  # open files: above what a Python process with mxnet imported needs alone
KILL_STEP, KILL_RANK = 15, 4  # a checkpoint every 10 steps: the restart resumes from step 10


@pytest.fixture(scope="module")
def digits_shards(s3_server, digits_csv):
    cfg, shards = shard_digits(f"s3://{s3_server.bucket}/test-many-roles", digits_csv, num_shards=WORKERS)
    # Batch 8 per worker: one epoch is 27 steps with 6 workers (a kill at 15 is mid-epoch).
    # Checkpoints are written in the loop (no upload in flight when the kill comes), so the restart
    # resumes from 10. A round whose roles cannot meet fails within a minute.
    return cfg.replace(optim={"epochs": 1, "batch_size": 8}, checkpoint={"every_n_steps": 10, "async_upload": False},
                       cluster={"num_workers": WORKERS, "num_servers": SERVERS, "kvstore": "dist_sync",
                                "job_timeout_s": 300, "start_timeout_s": 60}), shards


def test_six_workers_and_three_servers_under_a_low_open_files_limit_restart_in_place_and_finish(digits_shards,
                                                                                                s3_prefix, tmp_path):
    cfg, shards = digits_shards
    job = make_job(cfg, shards, s3_prefix)
    events_file = tmp_path / "events.jsonl"
    env = {"MXPIPE_EVENTS_FILE": str(events_file), "MXPIPE_FAULT_KILL_STEP": str(KILL_STEP),
           "MXPIPE_FAULT_KILL_RANK": str(KILL_RANK), "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fired")}
    # The supervisor and every role start under the low soft limit (the hard one is left alone),
    # as on a host whose default is too low for the job.
    python = tmp_path / "python-low-nofile"
    python.write_text(f"#!/bin/sh\nulimit -S -n {LOW_SOFT_LIMIT}\nexec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    roles = run_local(job, storage.join(s3_prefix, "job.json"), str(tmp_path / "home"), env, python=str(python))

    assert (tmp_path / "fired").exists(), "the kill never fired"
    status = read_status(storage.join(s3_prefix, "job_status.json"))
    assert status.state == "succeeded" and status.restarts == 1, status
    every_role = {"scheduler", *(f"server-{i}" for i in range(SERVERS)), *(f"worker-{i}" for i in range(WORKERS))}
    assert sorted(roles) == sorted([*every_role, *every_role]), roles  # two rounds of every role

    events = read_events(events_file)
    rounds = attempts(events)
    assert len(rounds) == 2 and rounds[1].resumed_from == 10
    for n, (start, end) in enumerate(zip([r.start for r in rounds], [r.start for r in rounds[1:]] + [float("inf")])):
        joined = [role_event_of(e) for e in events if start <= e["t"] < end]
        ranks = sorted(ev.rank for ev in joined if isinstance(ev, WorkerStarted))
        assert ranks == list(range(WORKERS)), f"round {n}: kvstore ranks {ranks}"
        assert all(ev.num_workers == WORKERS for ev in joined if isinstance(ev, WorkerStarted))
    lead = [(e["t"], role_event_of(e)) for e in events if e.get("role") == LEAD]
    assert [ev.global_step for _, ev in lead if isinstance(ev, FirstStep)] == [1]
    assert [ev.global_step for _, ev in lead if isinstance(ev, FirstStepAfterResume)] == [11]

    kill_t = (tmp_path / "fired").stat().st_mtime
    timeline = failure_timeline(events, kill_t)
    assert timeline["failed_role"].startswith("worker-") and timeline["resumed_from_step"] == 10
    assert 0 <= timeline["detect"] < 10.0, timeline  # one supervisor poll (0.2 s), on a loaded machine
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    assert metrics["num_workers"] == WORKERS and metrics["global_step"] == rounds[-1].points[-1][1] > KILL_STEP

