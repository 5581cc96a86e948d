"""A supervisor killed mid-training (``kill -9``), with a real local ps-lite job started by
``python -m training run``: its roles end themselves within 5 s (rank 0 after its emergency
checkpoint), the status record reads dead at once, and rerunning the command at once resumes
from that checkpoint: no step is lost."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from common.procs import Watch, is_running
from training.checkpoint.store import CheckpointStore
from training.launch.status import read_status

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "MXPIPE_SUPERVISOR_LOSS_TAG"
# The bound the roles get after their supervisor's death (none may run unsupervised longer).
ROLES_GONE_S = 5.0
# Slows every step of rank 0 in the first run, so the kill lands mid-epoch (the arithmetic is
# untouched). On rank 0: a delayed peer would let rank 0's loop run ahead of its engine, and the
# roles would rightly serve it for as many delayed steps before it can checkpoint.
SLOW_RANK_0 = {"MXPIPE_FAULT_STEP_DELAY_S": "0.3", "MXPIPE_FAULT_KILL_RANK": "0"}


def _wait_for(what, condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not (got := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(0.2)
    return got


def _run_argv(tmp_path):
    return [sys.executable, "-m", "training", "run", "--config", str(tmp_path / "cfg.json"),
            "--shards", str(tmp_path / "data" / "shards"), "--out", str(tmp_path / "run")]


def test_killed_supervisor_roles_end_and_a_rerun_resumes_at_once(tmp_path, digits_csv):
    from testkit.local_jobs import shard_digits

    cfg, _ = shard_digits(str(tmp_path / "data"), digits_csv)
    # Checkpoints at epoch ends only: a checkpoint mid-epoch can only be the emergency one.
    cfg = cfg.replace(checkpoint={"every_n_steps": 100000}, cluster={"num_workers": 2, "num_servers": 1})
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    tag = (TAG, uuid.uuid4().hex)
    env = {**os.environ, "PYTHONPATH": REPO, "MXPIPE_HOME": str(tmp_path / "home"), tag[0]: tag[1]}
    watch = Watch(tags=[tag])
    status_uri = str(tmp_path / "run" / "config" / "job_status.json")
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))

    # The first run, as a user starts it; it is killed too, so nothing but the roles themselves
    # can end them.
    first = subprocess.Popen(_run_argv(tmp_path), env={**env, **SLOW_RANK_0}, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Mid-epoch: progress in the record past the newest (epoch-end) checkpoint.
        _wait_for("progress past the newest checkpoint in the status record",
                  lambda: (s := read_status(status_uri)) is not None
                  and s.global_step > max(store.committed_steps(), default=0), 300)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        before = max(store.committed_steps(), default=0)
        status = read_status(status_uri)
        assert status.state == "running" and status.global_step > before, (status, before)
        assert is_running(status.pid, status.pid_started)  # the record names the very process
        os.kill(status.pid, signal.SIGKILL)
        killed = time.monotonic()

        # Dead as soon as the kernel has ended it, by pid and start time: its heartbeat is fresh.
        dead = _wait_for("the record to read dead", lambda: (s := read_status(status_uri)) and not s.live() and s, 1.0)
        assert dead.active and dead.age_s() < 10
        # Every role ends itself within the bound.
        left = watch.left(wait_s=ROLES_GONE_S - (time.monotonic() - killed))
        took = time.monotonic() - killed
        assert not left, f"{len(left)} role process(es) still running {took:.1f}s after the supervisor died"
    finally:
        first.kill()
        watch.check("the first run")

    # Rank 0 wrote its emergency checkpoint before it exited: past every step the supervisor saw.
    emergency = store.committed_steps()[0]
    assert emergency >= status.global_step > before, (emergency, status.global_step, before)

    # A rerun at once: not refused, resumes from the emergency checkpoint, and finishes.
    rerun = subprocess.run(_run_argv(tmp_path), env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    watch.check("the rerun")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "still live" not in rerun.stdout + rerun.stderr
    assert {int(s) for s in re.findall(r"resumed from step (\d+) ", rerun.stdout)} == {emergency}
    metrics = json.loads((tmp_path / "run" / "metrics" / "train.json").read_text())
    assert metrics["history"][-1]["epoch"] == cfg.optim.epochs - 1
