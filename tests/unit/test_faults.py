"""Fault injection (training.loop.faults): the environment is read once, into a FaultPlan, and
the plan keeps the documented semantics (chosen rank, pid file, process groups, once-file)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from common.settings import REPO_ROOT
from training.loop.faults import FaultPlan

pytestmark = pytest.mark.unit

FAULT_VARS = ("KILL_STEP", "KILL_RANK", "KILL_PID_FILE", "HANG_STEP", "TERM_STEP", "KILL_IN_UPLOAD_STEP",
              "STEP_DELAY_S", "ONCE_FILE")


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    for name in FAULT_VARS:
        monkeypatch.delenv(f"MXPIPE_FAULT_{name}", raising=False)


def _victim(**kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], **kw)


def _killed(proc: subprocess.Popen) -> bool:
    try:
        return proc.wait(timeout=5) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        return False


def test_no_fault_set_means_nothing_to_do():
    plan = FaultPlan.from_settings()
    assert plan == FaultPlan() and not plan.per_step and plan.before_commit_hook() is None
    plan.at_step(1, 1)


def test_the_environment_is_read_once_when_the_plan_is_built(tmp_path, monkeypatch):
    victim = _victim()
    try:
        pid_file, once = tmp_path / "pid", tmp_path / "fired"
        pid_file.write_text(f"{victim.pid}\n")
        monkeypatch.setenv("MXPIPE_FAULT_KILL_STEP", "3")
        monkeypatch.setenv("MXPIPE_FAULT_KILL_RANK", "0")
        monkeypatch.setenv("MXPIPE_FAULT_KILL_PID_FILE", str(pid_file))
        monkeypatch.setenv("MXPIPE_FAULT_ONCE_FILE", str(once))
        plan = FaultPlan.from_settings()
        # Changed after the plan was built: the plan does not see it.
        monkeypatch.setenv("MXPIPE_FAULT_KILL_STEP", "5")
        monkeypatch.setenv("MXPIPE_FAULT_KILL_RANK", "1")
        monkeypatch.delenv("MXPIPE_FAULT_KILL_PID_FILE")
        monkeypatch.delenv("MXPIPE_FAULT_ONCE_FILE")
        plan.at_step(5, 1)
        plan.at_step(3, 1)  # not the chosen rank
        assert victim.poll() is None and not once.exists()
        plan.at_step(3, 0)
        assert _killed(victim) and once.exists()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(5)


def test_once_file_fires_a_fault_only_once(tmp_path):
    victim = _victim()
    try:
        pid_file = tmp_path / "pid"
        pid_file.write_text(str(victim.pid))
        (tmp_path / "fired").touch()  # an earlier attempt fired it
        plan = FaultPlan(kill_step=2, kill_rank=0, kill_pid_file=str(pid_file), once_file=str(tmp_path / "fired"))
        plan.at_step(2, 0)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait(5)


def test_negative_pid_kills_the_process_group(tmp_path):
    leader = _victim(start_new_session=True)
    (tmp_path / "pgid").write_text(f"-{leader.pid}")
    FaultPlan(kill_step=4, kill_rank=0, kill_pid_file=str(tmp_path / "pgid")).at_step(4, 0)
    assert _killed(leader)


def test_missing_pid_file_means_no_kill_and_no_once_file(tmp_path):
    once = tmp_path / "fired"
    plan = FaultPlan(kill_step=4, kill_rank=0, kill_pid_file=str(tmp_path / "absent"), once_file=str(once))
    plan.at_step(4, 0)  # would SIGKILL this test process if the missing file fell back to our own pid
    assert not once.exists()


def test_step_delay_slows_only_the_chosen_worker():
    plan = FaultPlan(step_delay_s=0.2, kill_rank=1)
    started = time.monotonic()
    plan.at_step(1, 0)
    assert time.monotonic() - started < 0.1
    plan.at_step(1, 1)
    assert time.monotonic() - started >= 0.2


def test_term_step_sends_sigterm_to_the_chosen_worker_once(tmp_path):
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        plan = FaultPlan(term_step=6, kill_rank=0, once_file=str(tmp_path / "fired"))
        plan.at_step(5, 0)
        plan.at_step(6, 1)
        assert received == []
        plan.at_step(6, 0)
        plan.at_step(6, 0)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_kill_in_upload_hook_kills_the_writer_at_its_step_once(tmp_path):
    script = ("from training.loop.faults import FaultPlan\n"
              "hook = FaultPlan.from_settings().before_commit_hook()\n"
              "hook(4)\n"
              "hook(5)\n")
    env = {**os.environ, "MXPIPE_FAULT_KILL_IN_UPLOAD_STEP": "5", "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fired"),
           "PYTHONPATH": REPO_ROOT}

    def attempt() -> int:
        return subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT, timeout=60).returncode

    assert attempt() == -signal.SIGKILL
    assert attempt() == 0  # the retry runs clean


def test_kill_steps_fire_once_each(tmp_path, monkeypatch):
    monkeypatch.setenv("MXPIPE_FAULT_KILL_STEPS", "3, 7")
    monkeypatch.setenv("MXPIPE_FAULT_ONCE_FILE", str(tmp_path / "fired"))
    monkeypatch.setenv("MXPIPE_FAULT_KILL_RANK", "0")
    plan = FaultPlan.from_settings()
    assert plan.kill_steps == (3, 7) and plan.per_step
    for step in (3, 7):
        victim = _victim()
        try:
            (tmp_path / "pid").write_text(str(victim.pid))
            plan = FaultPlan(kill_steps=(3, 7), kill_rank=0, kill_pid_file=str(tmp_path / "pid"),
                             once_file=str(tmp_path / "fired"))
            plan.at_step(step - 1, 0)
            assert victim.poll() is None
            plan.at_step(step, 0)
            assert _killed(victim) and (tmp_path / f"fired-{step}").exists()
        finally:
            if victim.poll() is None:
                victim.kill()
            victim.wait(5)
    victim = _victim()
    try:
        (tmp_path / "pid").write_text(str(victim.pid))
        FaultPlan(kill_steps=(3, 7), kill_rank=0, kill_pid_file=str(tmp_path / "pid"),
                  once_file=str(tmp_path / "fired")).at_step(3, 0)  # a restarted round passes step 3 again
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait(5)
