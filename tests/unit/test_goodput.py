"""The soak benchmark's pure parts: goodput and failure timelines from an event log, the killer's
choice of a role and how it finds the roles (testkit/timeline.py, testkit/killer.py)."""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest

from testkit.killer import Killer, LiveRole, choose_victim, is_role_command, live_roles
from testkit.timeline import attempts, cadence_plans, failure_timeline, goodput
from common.events import (CheckpointCommitted, EpochDone, FirstStepAfterResume, Progress, Resumed, WorkerStarted,
                           event_line)
from common.procs import GroupSpawner
from testkit.waits import process_started

pytestmark = pytest.mark.unit


def line(t: float, text: str, role: str = "worker-0") -> dict:
    return {"t": t, "event": "line", "role": role, "text": f"INFO training.loop.worker: {text}"}


def event(t: float, ev, role: str = "worker-0") -> dict:
    """A role's event line (common.events) as the supervisor recorded it."""
    return {"t": t, "event": "line", "role": role, "text": f"INFO events: {event_line(ev)}"}


def progress(t: float, step: int) -> dict:
    return event(t, Progress(epoch=0, step=step, steps=328, global_step=step))


# A run killed at t=33 (worker-0 near step 330), resumed from the checkpoint of step 250.
KILL_T = 33.0
EVENTS = [
    {"t": 0.0, "event": "job_start", "job_uri": "s3://b/job.json"},
    event(2.0, WorkerStarted(rank=0, num_workers=2)),
    progress(10.0, 100), event(10.5, Progress(epoch=0, step=100, steps=328, global_step=100), role="worker-1"),
    progress(20.0, 200), event(25.0, CheckpointCommitted(step=250, uri="s3://b/ckpt/step-00000250/a")),
    progress(30.0, 300),
    {"t": 33.2, "event": "role_failed", "role": "server-0", "host": "127.0.0.1", "why": "killed by SIGKILL"},
    {"t": 34.2, "event": "roles_stopped", "stopped": 4, "seconds": 1.0},
    {"t": 36.0, "event": "job_start", "job_uri": "s3://b/job.json"},
    event(40.0, WorkerStarted(rank=1, num_workers=2)),
    event(43.0, Resumed(step=250, epoch=0, step_in_epoch=250), role="worker-1"),
    event(44.0, FirstStepAfterResume(global_step=251, resumed_from=250)),
    progress(50.0, 310), progress(80.0, 610),
    event(81.0, EpochDone(epoch=1, global_step=620, record={"epoch": 1})),
    {"t": 83.0, "event": "roles_stopped", "stopped": 4, "seconds": 2.0},
]


def test_attempts_split_at_job_starts_with_resume_step_and_lead_marks():
    first, second = attempts(EVENTS)
    assert (first.resumed_from, first.points) == (0, [(10.0, 100), (20.0, 200), (30.0, 300)])
    assert second.resumed_from == 250
    assert second.points == [(44.0, 251), (50.0, 310), (80.0, 610), (81.0, 620)]
    assert first.seconds_per_step() == pytest.approx(0.1)


def test_failure_timeline_terms():
    t = failure_timeline(EVENTS, KILL_T)
    assert {k: round(t[k], 6) for k in ("detect", "teardown", "retry", "cluster_start", "restore", "first_step")} \
        == {"detect": 0.2, "teardown": 1.0, "retry": 1.8, "cluster_start": 4.0, "restore": 3.0, "first_step": 1.0}
    assert t["total"] == pytest.approx(11.0)
    assert (t["resumed_from_step"], t["failed_role"]) == (250, "server-0")


def test_goodput_counts_only_kept_steps():
    g = goodput(EVENTS, [KILL_T])
    spp2 = 37.0 / 369
    # attempt 1 kept steps 1..250: t(250) - t(1) + one step = 25 - 0.1 + 0.1; attempt 2 kept 251..620.
    assert g["productive_s"] == pytest.approx(25.0 + (81.0 - 44.0) + spp2)
    assert g["wall_s"] == pytest.approx(81.0)
    assert g["goodput"] == pytest.approx(g["productive_s"] / 81.0)
    (f,) = g["failures"]
    assert (f["step_at_kill"], f["steps_recomputed"]) == (330, 80)
    assert f["restart"] == pytest.approx(5.8)
    assert f["lost_s"] == pytest.approx(11.0 + 80 * 0.1)
    assert (g["final_step"], g["attempts"]) == (620, 2)


def test_step_at_a_kill_is_never_below_a_committed_checkpoint():
    # The marks say step 300 at t=30 (~330 at t=33), but a commit of step 340 arrived at t=32.5.
    run = EVENTS[:6] + [event(32.5, CheckpointCommitted(step=340, uri="s3://b/ckpt/step-00000340/a"))] + EVENTS[6:]
    first = attempts(run)[0]
    assert first.committed == [(25.0, 250), (32.5, 340)]
    assert first.step_at(KILL_T, 0.1) == 340 and first.step_at(26.0, 0.1) == pytest.approx(260)


def test_goodput_of_a_run_without_failures_is_its_steady_share():
    run = [{"t": 0.0, "event": "job_start"}, progress(5.0, 50), progress(15.0, 150)]
    g = goodput(run, [])
    assert g["goodput"] == pytest.approx((15.0 - 0.1 + 0.1) / 15.0) and g["failures"] == []


def test_goodput_refuses_a_kill_that_was_not_retried():
    with pytest.raises(RuntimeError, match="not retried"):
        goodput(EVENTS[:7], [KILL_T])


def test_goodput_refuses_a_log_without_steps():
    with pytest.raises(RuntimeError, match="step marks"):
        goodput([{"t": 0.0, "event": "job_start"}], [])


def test_cadence_plans_are_rank_0s_auto_choices():
    plan = "every 120 steps (5.2s of training; Young/Daly with checkpoint cost 0.045s = blocked 0.010s + …)"
    run = [line(1.0, f"checkpoint cadence (auto): {plan}"), line(1.1, "checkpoint cadence (auto): x", role="worker-1"),
           line(9.0, f"checkpoint cadence (auto), re-planned (drift > 25%): {plan}")]
    assert cadence_plans(run) == [plan, f"re-planned (drift > 25%): {plan}"]


def test_choose_victim_is_seeded_and_ignores_discovery_order():
    roles = [LiveRole("worker-1", 14), LiveRole("scheduler", 11), LiveRole("server-0", 12), LiveRole("worker-0", 13)]
    picks = [choose_victim(roles, rng).name for rng in [random.Random(7)] for _ in range(20)]
    again = [choose_victim(list(reversed(roles)), rng).name for rng in [random.Random(7)] for _ in range(20)]
    assert picks == again
    assert set(picks) == {"scheduler", "server-0", "worker-0", "worker-1"}
    assert LiveRole("server-0", 12).kind == "server"
    with pytest.raises(ValueError, match="no live role"):
        choose_victim([], random.Random(0))


def test_role_commands():
    assert is_role_command("worker", ["/v/python", "-m", "training", "worker", "s3://b/job.json"])
    assert is_role_command("scheduler", ["/v/python", "-c", "from common.mx import import_mxnet; import_mxnet()"])
    assert not is_role_command("worker", ["sleep", "30"])
    assert not is_role_command("provision", ["/v/python", "-m", "training", "worker"])


def _fake_role(spawner: GroupSpawner, name: str, argv_tail: str) -> int:
    """Spawn and record a stand-in role; returns once it runs its command line (right after the
    spawn it may still be in its exec, its command line empty: no role's yet)."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)", argv_tail]
    pid = spawner.spawn(name, argv, dict(os.environ), stdout=None).pid
    process_started(pid, argv)
    return pid


def test_live_roles_and_killer_use_the_newest_attempts_records(tmp_path: Path):
    procs = tmp_path / "home" / "clusters" / "c1" / "procs"
    old, new = GroupSpawner(str(procs / "attempt-1")), None
    try:
        _fake_role(old, "worker-0", "training worker")
        new = GroupSpawner(str(procs / "attempt-2"))
        pid = _fake_role(new, "worker-1", "training worker")
        _fake_role(new, "server-0", "not a role")  # its command line is no role's: never picked
        os.utime(procs / "attempt-2", (time.time() + 1, time.time() + 1))
        assert live_roles(str(tmp_path / "home")) == [LiveRole("worker-1", pid)]
        events = tmp_path / "events.jsonl"
        events.write_text(json.dumps({"t": time.time(), "event": "job_start"}) + "\n")
        killer = Killer(str(tmp_path / "home"), events, period_s=0.2, seed=1, max_kills=1)
        killer.start()
        killer.join(timeout=20)
        assert [k["role"] for k in killer.kills] == ["worker-1"]
        assert new.records[0].pid == pid and _wait_dead(pid)
    finally:
        old.kill_all(grace_s=1.0)
        if new is not None:
            new.kill_all(grace_s=1.0)


def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
        time.sleep(0.05)
    return False


def test_the_comparison_runs_each_interval_once_a_round_in_a_rotated_order():
    from benchmarks.goodput import comparison_order

    assert comparison_order([10, 100, "auto"], 2) == [(0, 10), (0, 100), (0, "auto"),
                                                      (1, 100), (1, "auto"), (1, 10)]


def test_without_compare_there_is_no_comparison_to_run():
    """``goodput.py`` without ``--compare`` (the headline soak only) runs no comparison soak and
    goes on to write its result file."""
    from benchmarks.goodput import comparison_order

    assert comparison_order([], 1) == []
    assert comparison_order([], 3) == []


def test_the_cadence_comparison_averages_runs_with_every_kill_and_ranks_by_wall_time():
    from benchmarks.goodput import summarise

    def run(rnd, every, wall, goodput, kills=2):
        return {"round": rnd, "every_n_steps": every, "wall_s": wall, "goodput": goodput, "lost_s": [5.0] * kills}

    rows = [run(0, 10, 130, 0.85), run(0, 100, 110, 0.80), run(0, "auto", 105, 0.82),
            run(1, 10, 126, 0.86), run(1, 100, 100, 0.81, kills=1), run(1, "auto", 108, 0.83),
            run(2, 100, 112, 0.79), run(2, "auto", 109, 0.80)]
    out = summarise(rows, max_kills=2)
    assert out["left_out"] == ["every 100, round 1: 1 of 2 kills landed"]
    assert out["runs_averaged"] == {"10": 2, "100": 2, "auto": 3}
    assert out["mean_wall_s"]["100"] == 111  # the run that missed a kill (100 s) is not averaged
    # By wall time the best fixed interval is 100, by goodput 10 (slower steps, more productive seconds).
    assert out["best_fixed_by_wall_s"] == {"every_n_steps": 100, "mean_wall_s": 111}
    assert out["best_fixed_by_goodput"]["every_n_steps"] == 10
    assert out["auto_minus_best_fixed_wall_s"] == pytest.approx((105 + 108 + 109) / 3 - 111)
    assert out["auto_minus_best_fixed_wall_s_per_round"] == [105 - 110, 109 - 112]  # rounds 0 and 2: paired
