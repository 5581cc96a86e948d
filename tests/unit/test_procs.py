"""common.procs with real processes: the SIGTERM → grace → SIGKILL escalation (a child that
ignores SIGTERM, an orphaned grandchild, a service's helper in a session of its own), the pid
reuse guard, and the leftover proof that every process-starting test relies on."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import psutil
import pytest
from common.procs import (
    GroupRecord,
    GroupSpawner,
    LeftBehind,
    Watch,
    free_port,
    group_members,
    kill_groups,
    kill_recorded,
    start_time,
    stop_groups,
)
from common.procs.groups import KILL_WAIT_S
from testkit import ROOT
from testkit.waits import process_started, wait_for

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_start_time_is_the_clock_tick_value_records_have_always_held():
    # Field 22 of /proc/PID/stat: what GroupRecord and pid files held before psutil.
    with open(f"/proc/{os.getpid()}/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    assert start_time(os.getpid()) == ticks
    assert start_time(2 ** 22 + 1) is None  # above pid_max: never a process


def test_child_that_ignores_sigterm_is_killed_after_the_grace(nothing_left):
    spawner = GroupSpawner(nothing_left.record_dirs[0])
    proc = spawner.spawn("stubborn", [sys.executable, "-c", IGNORE_TERM], dict(os.environ))
    assert proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    assert kill_groups([proc.pid], grace_s=1.0) == 1
    took = time.monotonic() - started
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert 1.0 <= took < 1.0 + KILL_WAIT_S, took
    assert kill_groups([proc.pid], grace_s=1.0) == 0  # nothing left to stop


def test_group_with_an_orphaned_grandchild_is_fully_stopped(tmp_path, nothing_left):
    # leader sh -> sh -> sleep; the sleep ignores SIGTERM and outlives both shells, re-parented.
    (tmp_path / "inner.sh").write_text("trap '' TERM; exec sleep 300\n")
    (tmp_path / "middle.sh").write_text(f"sh {tmp_path}/inner.sh & echo $!; wait\n")
    spawner = GroupSpawner(nothing_left.record_dirs[0])
    proc = spawner.spawn("tree", ["sh", "-c", f"sh {tmp_path}/middle.sh & wait"], dict(os.environ))
    grandchild = int(proc.stdout.readline())
    wait_for(lambda: psutil.Process(grandchild).name() == "sleep", timeout_s=10, what="the trap set")
    assert {proc.pid, grandchild} <= {p.pid for p in group_members([proc.pid])}
    assert psutil.Process(grandchild).ppid() != proc.pid
    started = time.monotonic()
    assert kill_groups([proc.pid], grace_s=1.0) == 1
    assert time.monotonic() - started >= 1.0  # the grandchild took the SIGKILL
    proc.wait(timeout=5)
    assert group_members([proc.pid]) == [] and _gone(grandchild)


def test_service_session_takes_in_a_helper_that_left_the_group(tmp_path, nothing_left):
    spawner = GroupSpawner(nothing_left.record_dirs[0])
    proc = spawner.spawn("service", ["sh", "-c", "setsid sleep 300 & echo $!; wait"], dict(os.environ))
    helper = int(proc.stdout.readline())
    nothing_left.group(proc.pid).session(proc.pid)
    wait_for(lambda: psutil.Process(helper).name() == "sleep", timeout_s=10, what="setsid run")
    assert helper not in {p.pid for p in group_members([proc.pid])}
    assert helper in {p.pid for p in group_members([proc.pid], sessions=True)}
    assert stop_groups([proc.pid], grace_s=2.0, sessions=True) == []
    proc.wait(timeout=5)
    assert _gone(helper)


def test_a_record_whose_pid_now_is_another_process_is_left_alone(tmp_path, nothing_left):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    nothing_left.group(proc.pid)
    try:
        stale = GroupRecord(name="old", pid=proc.pid, pgid=proc.pid, start_time=start_time(proc.pid) - 1)
        (tmp_path / "recs").mkdir()
        (tmp_path / "recs" / "old.json").write_text(json.dumps(asdict(stale)))
        assert not stale.may_be_ours()
        assert kill_recorded(str(tmp_path / "recs"), grace_s=0.5) == []
        assert proc.poll() is None
    finally:
        kill_groups([proc.pid], grace_s=1.0)
        proc.wait(timeout=5)


def test_watch_names_a_leaked_process_and_kills_it():
    watch = Watch().tag("MXPIPE_TEST_LEAK", f"leak-{os.getpid()}-{time.monotonic_ns()}")
    leaked = subprocess.Popen(["sleep", "300"], env={**os.environ, **watch.env}, start_new_session=True)
    process_started(leaked.pid, ["sleep", "300"])  # in its exec, its environment (the tag) reads empty
    with pytest.raises(LeftBehind) as err:
        watch.check("a leaky run", wait_s=0.5)
    assert f"pid {leaked.pid}: sleep 300" in str(err.value) and "a leaky run left 1 process" in str(err.value)
    assert leaked.wait(timeout=5) == -signal.SIGKILL


def test_watch_waits_for_a_process_that_is_just_exiting():
    watch = Watch().tag("MXPIPE_TEST_LEAK", f"exiting-{os.getpid()}-{time.monotonic_ns()}")
    exiting = subprocess.Popen(["sleep", "2"], env={**os.environ, **watch.env}, start_new_session=True)
    process_started(exiting.pid, ["sleep", "2"])  # seen by the watch before it exits
    assert watch.running() == [exiting.pid]
    watch.check("a run", wait_s=30.0)
    exiting.wait(timeout=5)


LEAKY_TEST = """
import os, subprocess, pytest
import common.procs.leftovers

common.procs.leftovers.LEFTOVER_WAIT_S = 1.0


@pytest.mark.unit
def test_leaks(nothing_left):
    from testkit.waits import process_started

    leak = subprocess.Popen(["sleep", "300"], env={**os.environ, **nothing_left.env}, start_new_session=True)
    process_started(leak.pid, ["sleep", "300"])  # in its exec, its environment (the tag) reads empty
"""


def test_nothing_left_fixture_fails_a_test_that_leaks(pytester, monkeypatch, nothing_left):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY_TEST)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("MXPIPE_OUTER_TAG", nothing_left.env["MXPIPE_TEST_TAG"])
    nothing_left.tag("MXPIPE_OUTER_TAG", nothing_left.env["MXPIPE_TEST_TAG"])  # the inner leak, too
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_leaks left 1 process(es) running (now killed):*",
                                 "*pid *: sleep 300*"])


def test_free_port_variants():
    taken: set[int] = set()
    port = free_port(stable=True, offset=10000, taken=taken)
    assert 10000 <= port < 22000 and taken == {port, port + 10000}
    assert free_port(stable=True, taken=taken) not in {port, port + 10000}
    assert free_port() >= 1024
    with pytest.raises(ValueError, match="stable=True"):
        free_port(offset=10000)


# A role holding 50 MB that says so, then exits when its stdin closes.
HOLDER = "import sys\nx = bytearray(50_000_000)\nprint('holding', flush=True)\nsys.stdin.read()\n"


def _holder() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    return proc


def test_usage_keeps_the_last_live_sample_of_an_exited_unreaped_role():
    """A role that exited but is not reaped yet (a zombie) reads as 0 bytes resident: that is no
    sample, so the last live one stands (the live run's final RSS point is not 0)."""
    from common.procs.usage import UsageMeter

    proc = _holder()
    try:
        meter = UsageMeter()
        live = meter.sample({"role": proc.pid})["role"].rss_bytes
        proc.stdin.close()  # type: ignore[union-attr]
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, timeout_s=30,
                 what="the role a zombie")
        assert live > 40_000_000 and meter.sample({"role": proc.pid})["role"].rss_bytes == live
    finally:
        proc.wait(timeout=30)


def test_usage_keeps_the_last_live_memory_of_a_role_that_is_exiting(monkeypatch):
    """Between releasing its memory and becoming a zombie an exiting process still runs, and
    reads as 0 bytes resident (the kernel's figure for a task without memory; simulated here on
    a live process, the window is too short to catch): no sample of its memory, so the last live
    one stands, while its CPU time still counts."""
    from common.procs.usage import UsageMeter

    proc = _holder()
    try:
        meter = UsageMeter()
        live = meter.sample({"role": proc.pid})["role"].rss_bytes
        # psutil's platform layer, under its per-call cache (Process.oneshot).
        platform = psutil._psplatform.Process  # type: ignore[attr-defined]
        real = platform.memory_info
        monkeypatch.setattr(platform, "memory_info",
                            lambda self: real(self)._replace(rss=0) if self.pid == proc.pid else real(self))
        after = meter.sample({"role": proc.pid})["role"]
        assert live > 40_000_000 and after.rss_bytes == live
        assert after.last_seen > after.first_seen  # a sample all the same
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


def test_a_scheduler_or_server_raises_its_soft_open_files_limit_to_the_hard_one_before_it_starts():
    """ps-lite connects every role to every other one (common.procs.limits): a role started under
    a low soft limit raises it before it imports mxnet (the part of its command before that runs here)."""
    import resource

    from common.roles import SERVER, role_argv

    code = role_argv(SERVER, "j")[-1]
    before_mxnet = code[:code.index("from common.mx import")]
    probe = before_mxnet + "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = min(64, hard)

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         preexec_fn=low_soft_limit, check=True)
    soft, got_hard = map(int, out.stdout.split())
    assert got_hard == hard and soft > low and (soft == hard or hard == resource.RLIM_INFINITY)
