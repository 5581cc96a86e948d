"""The supervisor as a job of its own (``python -m training supervise``), with shell scripts for
roles: its status record (states, progress from rank 0's events, a bounded write rate), SIGTERM as
an orderly stop (rank 0 ends on its own first), the refusal to start beside a live job, the
failure kinds, and the local cluster starting it detached and stopping it within its bound."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from common.config import TrainConfig
from common.events import EpochDone, Progress, WorkerStarted, event_line
from training.launch.job import JobSpec
from training.launch.status import (FAILED, RUNNING, STOPPED, SUCCEEDED, JobStatus, StatusWriter, progress_of,
                                    read_status)
from tests.unit import script_cluster
from testkit import REPO
from testkit.waits import wait_for

pytestmark = pytest.mark.unit

# A worker that names its kvstore rank, logs progress as a worker does (a human line and its
# event, common.events), and on SIGTERM says so (rank 0: "checkpoints") and exits 75. ps-lite
# ranks need not follow the role names.
def _loop(rank):
    on_term = "emergency checkpoint at step $s" if rank == 0 else "rank 1 leaving"
    return (f"echo 'worker {rank}/2 started (kvstore=dist_sync)'; "
            f"echo '{event_line(WorkerStarted(rank=rank, num_workers=2))}'; trap 'echo {on_term}; exit 75' TERM; s=0; "
            "while :; do s=$((s+1)); echo \"progress epoch=1 step=$s/100 global_step=$((100+s)) loss=0.1\"; "
            "printf '@event {\"v\":1,\"kind\":\"progress\",\"epoch\":1,\"step\":%d,\"steps\":100,"
            "\"global_step\":%d}\\n' $s $((100+s)); sleep 0.2; done")


LOOP = _loop(0)


def _job(tmp_path, watch, scripts, **cluster):
    cfg = TrainConfig().replace(cluster={"num_workers": 2, "num_servers": 1, "start_timeout_s": 30,
                                         "stall_timeout_s": 30, "max_restarts_without_progress": 0, **cluster},
                                checkpoint={"preempt_grace_s": 5})
    job = JobSpec(config=cfg, shards_prefix=str(tmp_path / "shards"), checkpoint_prefix=str(tmp_path / "ckpt"),
                  model_prefix=str(tmp_path / "model"), metrics_uri=str(tmp_path / "metrics.json"),
                  status_uri=str(tmp_path / "job_status.json"),
                  cluster=script_cluster.description(watch.record_dirs[0], watch.env, scripts))
    uri = str(tmp_path / "job.json")
    job.save(uri)
    return job, uri


def _supervise(uri, job_id="1-abc", watch=None):
    env = {**os.environ, **(watch.env if watch else {})}
    return subprocess.Popen([sys.executable, "-m", "training", "supervise", uri, "--job-id", job_id, "--attempt", "1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_progress_is_read_from_rank_0_progress_and_epoch_events():
    assert progress_of("INFO events: " + event_line(Progress(epoch=2, step=5, steps=40, global_step=85))) == (2, 85)
    assert progress_of(event_line(EpochDone(epoch=3, global_step=160, record={}))) == (4, 160)
    assert progress_of("training done: leaving the kvstore") is None
    assert progress_of("progress epoch=2 step=5/40 global_step=85 loss=0.3 samples/s=10") is None  # human text


def test_writer_bounds_its_rate_but_writes_every_state_change(tmp_path):
    uri = str(tmp_path / "s.json")
    w = StatusWriter(uri, JobStatus(state="starting", job_id="j"), min_interval_s=60, heartbeat_s=60)
    w.update()
    first = read_status(uri)
    w.progress(event_line(Progress(epoch=0, step=1, steps=9, global_step=1)))  # within the bound: kept, not written
    assert read_status(uri).global_step == 0 and w.status.global_step == 1
    w.update(state=RUNNING)  # a state change is written at once, with the progress so far
    got = read_status(uri)
    assert (got.state, got.global_step) == (RUNNING, 1) and got.heartbeat >= first.heartbeat
    assert w.finish(SUCCEEDED) and read_status(uri).state == SUCCEEDED


def test_a_record_is_live_only_while_active_and_fresh():
    now = time.time()
    s = JobStatus(state=RUNNING, job_id="j", heartbeat=now - 5)
    assert s.live(now, stale_after_s=60) and not s.live(now, stale_after_s=2)
    assert not replace(s, state=SUCCEEDED).live(now)


def test_job_succeeds_with_its_progress_in_the_record(tmp_path, nothing_left):
    done = (f"echo 'progress epoch=0 step=3/3 global_step=3 loss=0.5'; "
            f"echo '{event_line(Progress(epoch=0, step=3, steps=3, global_step=3))}'; sleep 0.3; echo done")
    job, uri = _job(tmp_path, nothing_left, {"worker-0": done, "worker-1": done, "scheduler": "sleep 0.5",
                                             "server-0": "sleep 0.5"})
    proc = _supervise(uri, watch=nothing_left)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    status = read_status(job.status_uri)
    assert (status.state, status.job_id, status.attempt, status.global_step) == (SUCCEEDED, "1-abc", 1, 3)
    assert status.pid == proc.pid and not status.error


def test_sigterm_stops_the_job_in_order_and_records_stopped(tmp_path, nothing_left):
    job, uri = _job(tmp_path, nothing_left, {"worker-0": _loop(1), "worker-1": _loop(0)})
    proc = _supervise(uri, watch=nothing_left)
    wait_for(lambda: (s := read_status(job.status_uri)) and s.state == RUNNING and s.global_step > 100,
             timeout_s=60, poll_s=0.2, what="the job running with progress")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 75, out
    status = read_status(job.status_uri)
    assert status.state == STOPPED and "stopped on request" in status.error
    # rank 0 (here the role worker-1) was asked alone first and ended on its own, then the others
    assert out.index("[worker-1@host-worker-1] emergency checkpoint at step") < out.index("rank 1 leaving")
    assert took < 5 + 1 + 5 + 5, took  # preempt_grace_s + 1, the others' grace, a margin
    nothing_left.check("the stopped supervisor")


def test_deterministic_failure_is_recorded_as_such(tmp_path, nothing_left):
    job, uri = _job(tmp_path, nothing_left, {"worker-0": "echo 'bad input: no label column'; exit 2"})
    proc = _supervise(uri, watch=nothing_left)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    status = read_status(job.status_uri)
    assert status.state == FAILED and status.deterministic and "bad input" in status.error


def test_refuses_to_start_beside_a_live_job_on_the_same_prefix(tmp_path, nothing_left):
    job, uri = _job(tmp_path, nothing_left, {})
    live = JobStatus(state=RUNNING, job_id="1-other", heartbeat=time.time(), host="h", pid=1)
    with open(job.status_uri, "wb") as fh:
        fh.write(live.to_json())
    proc = _supervise(uri, job_id="2-new", watch=nothing_left)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 4 and "refusing to start job 2-new: job 1-other" in out
    assert read_status(job.status_uri) == live


def test_local_cluster_starts_the_supervisor_detached_and_stops_it_within_the_bound(tmp_path, nothing_left):
    from infra.cluster import ClusterSpec
    from infra.local_cluster import LocalCluster

    cluster = LocalCluster("c1", ClusterSpec(run_tag="r", workers=2, servers=1), home=str(tmp_path / "home"))
    os.makedirs(cluster.state_dir)
    nothing_left.records(os.path.join(cluster.jobs_dir, "procs"))
    job, uri = _job(tmp_path, nothing_left, {"worker-0": LOOP, "worker-1": _loop(1)})
    where = cluster.start_supervisor(uri, job_id="1-det", attempt=1, env={**os.environ, **nothing_left.env})
    assert where["log"].endswith("1-det.log")
    wait_for(lambda: (s := read_status(job.status_uri)) and s.state == RUNNING, timeout_s=60, poll_s=0.2,
             what="the job running")
    assert os.getsid(where["pid"]) == where["pid"]  # a session of its own: it outlives its starter
    started = time.monotonic()
    assert cluster.stop_job(grace_s=30) == ["1-det"]
    assert time.monotonic() - started < 5 + 1 + 5 + 5
    assert read_status(job.status_uri).state == STOPPED
    with open(where["log"]) as fh:
        assert "emergency checkpoint at step" in fh.read()
    assert cluster.stop_job(grace_s=1) == []  # idempotent
    nothing_left.check("the detached supervisor")
    assert json.loads(open(job.status_uri).read())["job_id"] == "1-det"


def test_a_cluster_that_cannot_be_loaded_is_a_recorded_deterministic_failure(tmp_path, nothing_left):
    job, uri = _job(tmp_path, nothing_left, {})
    JobSpec(**{**job.__dict__, "cluster": {"factory": "no.such.module:attach", "description": {}}}).save(uri)
    proc = _supervise(uri, watch=nothing_left)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "error: cannot load the cluster factory 'no.such.module:attach'" in out
    status = read_status(job.status_uri)
    assert status.state == FAILED and status.deterministic and "no.such.module" in status.error


def _detached_job(tmp_path, worker_script):
    """A one-worker job without ps-lite (kvstore ``local``) on a local cluster whose worker runs
    ``worker_script``: the whole detached path in seconds."""
    from training.launch.detached import local_cluster

    cfg = TrainConfig().replace(cluster={"num_workers": 1, "num_servers": 1, "kvstore": "local",
                                         "start_timeout_s": 30, "stall_timeout_s": 30,
                                         "max_restarts_without_progress": 0},
                                checkpoint={"preempt_grace_s": 2})
    job = JobSpec(config=cfg, shards_prefix="", checkpoint_prefix="", model_prefix="", metrics_uri="",
                  status_uri=str(tmp_path / "job_status.json"),
                  cluster=local_cluster("det", cfg, home=str(tmp_path / "home"),
                                        worker_argv=["sh", "-c", worker_script]))
    uri = str(tmp_path / "job.json")
    job.save(uri)
    return uri


def test_run_detached_returns_the_final_record_and_relays_the_log(tmp_path, nothing_left, caplog):
    from training.launch.detached import run_detached

    uri = _detached_job(tmp_path, f"echo 'worker 0/1 started'; echo 'progress epoch=0 step=3/3 global_step=3 loss=1'; "
                                  f"echo '{event_line(Progress(epoch=0, step=3, steps=3, global_step=3))}'")
    caplog.set_level("INFO", logger="training.launch.launcher")
    status = run_detached(uri, env={**os.environ, **nothing_left.env}, timeout_s=120)
    assert status.state == SUCCEEDED and status.global_step == 3
    assert "[worker-0@127.0.0.1] progress epoch=0" in caplog.text  # the supervisor's lines, relayed
    nothing_left.check("the detached job")


def test_run_detached_raises_the_roles_failure_from_the_record(tmp_path, nothing_left):
    from training.launch.detached import run_detached
    from training.launch.launcher import JobFailed

    uri = _detached_job(tmp_path, "echo 'worker 0/1 started'; echo 'boom: out of memory'; exit 7")
    with pytest.raises(JobFailed) as failed:
        run_detached(uri, env={**os.environ, **nothing_left.env}, timeout_s=120)
    err = failed.value
    assert err.role == "worker-0" and err.host == "127.0.0.1" and err.exit_code == 7 and not err.deterministic
    assert "boom: out of memory" in str(err) and "last lines of worker-0" in str(err)
    assert "(the job's log: " in str(err)  # where the whole story is: in storage, not on a host
    nothing_left.check("the detached job")


def test_run_detached_stops_a_job_past_its_bound_in_order(tmp_path, nothing_left):
    from training.launch.detached import run_detached
    from training.launch.launcher import JobFailed

    uri = _detached_job(tmp_path, "echo 'worker 0/1 started'; trap 'echo leaving; exit 75' TERM; "
                                  "while :; do sleep 0.2; done")
    started = time.monotonic()
    with pytest.raises(JobFailed, match="did not end within its bound of 5s; it was stopped"):
        run_detached(uri, env={**os.environ, **nothing_left.env}, timeout_s=5)
    assert time.monotonic() - started < 5 + 2 + 5 + 10  # the bound, the grace, the other roles, start-up
    assert read_status(str(tmp_path / "job_status.json")).state == STOPPED
    nothing_left.check("the detached job")


def test_run_detached_never_starts_beside_a_live_job(tmp_path, nothing_left):
    from training.launch.detached import run_detached
    from training.launch.launcher import JobFailed

    uri = _detached_job(tmp_path, "echo never")
    StatusWriter(str(tmp_path / "job_status.json"), JobStatus(state=RUNNING, job_id="1-live", host="h", pid=7)).update()
    with pytest.raises(JobFailed, match="job 1-live is still live"):
        run_detached(uri, env={**os.environ, **nothing_left.env}, timeout_s=60)
    assert not os.path.exists(tmp_path / "home" / "jobs")  # no supervisor was started, nothing stopped
    assert read_status(str(tmp_path / "job_status.json")).job_id == "1-live"
