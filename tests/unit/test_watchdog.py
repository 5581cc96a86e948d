"""A supervisor's liveness and its roles' watch on it, with real processes: the identity by pid and
start time (a reused pid, another process table), the status record judged by it, and a role
that ends itself once its supervisor is gone (its standard input closed, or its pid gone)."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from common.procs.identity import ProcessIdentity, process_table
from common.procs.watchdog import (EXIT_SUPERVISOR_GONE, PEER_LINGER_S, STDIN, SUPERVISOR_ENV, ends_itself,
                                   supervised_by, watch_supervisor)
from training.launch.status import RUNNING, JobStatus

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# A role: its watch, then a long sleep (the main thread of a real role trains or waits in ps-lite).
ROLE = ("from common.procs.watchdog import watch_supervisor; watch_supervisor(); "
        "print('ready', flush=True); import time; time.sleep(120)")
# A role that keeps using CPU for BUSY_S after it saw its supervisor go (serving rank 0), then idles.
BUSY_S = 4.0
BUSY = ("import time; from common.procs.watchdog import watch_supervisor; watch_supervisor(); "
        "print('ready', flush=True); import sys; sys.stdin.read(); t = time.monotonic() + %s; "
        "exec('while time.monotonic() < t: pass'); time.sleep(120)" % BUSY_S)
# The checkpoint writer: its SIGTERM is the preemption path, here a line and exit 75.
WRITER = ("import os, signal, sys; "
          "signal.signal(signal.SIGTERM, lambda *a: (print('preempted', flush=True), os._exit(75))); "
          "from common.procs.watchdog import preempt_on_supervisor_loss, watch_supervisor; "
          "watch_supervisor(); preempt_on_supervisor_loss(30); print('ready', flush=True); "
          "import time; [time.sleep(0.05) for _ in range(2400)]")


def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _close_its_pipe(code: str, *, bound_s: float, open_s: float = 0.0) -> tuple[subprocess.Popen, float, str, str]:
    """Start ``code`` as a role watching its standard input (kept open ``open_s`` first), close
    that pipe as a dying supervisor's kernel would, and wait up to ``bound_s`` for the role to
    exit: the process, how long it took, its stdout and stderr."""
    role = subprocess.Popen([sys.executable, "-c", code], env=_env(**supervised_by(None)), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert role.stdout.readline().strip() == "ready"
        time.sleep(open_s)
        assert role.poll() is None  # open: nothing happens
        role.stdin.close()
        started = time.monotonic()
        role.wait(timeout=bound_s)
        took = time.monotonic() - started
    finally:
        role.kill()
        role.wait(timeout=30)
    return role, took, role.stdout.read(), role.stderr.read()


def test_identity_is_pid_start_time_and_process_table():
    me = ProcessIdentity.of()
    assert me.visible and me.running() is True and me.table == process_table() != ""
    assert ProcessIdentity.from_text(me.to_text()) == me
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = ProcessIdentity.of(child.pid) if child.poll() is None else ProcessIdentity(me.table, child.pid, 1)
    child.wait(timeout=30)
    assert gone.running() is False
    assert replace(me, started=me.started - 1).running() is False  # the same pid, a later process
    assert replace(me, table="another-boot/pid:[1]").running() is None  # not this machine's to judge
    with pytest.raises(ValueError, match="TABLE PID START_TICKS"):
        ProcessIdentity.from_text("12345")


def test_a_record_whose_supervisor_is_gone_here_is_dead_at_once():
    now = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    them = ProcessIdentity.of(child.pid)
    rec = JobStatus(state=RUNNING, job_id="j", heartbeat=now, host="h", pid=them.pid, process_table=them.table,
                    pid_started=them.started)
    assert rec.live(now) and rec.supervisor_running() is True
    child.kill()
    child.wait(timeout=30)
    # A fresh heartbeat does not keep a supervisor alive that this machine saw go.
    assert not rec.live(now) and rec.supervisor_running() is False
    assert f"pid {them.pid} on h, this machine" in rec.gone_reason(now)
    # A supervisor running here is live whatever its heartbeat's age (a storage outage).
    me = ProcessIdentity.of()
    old = replace(rec, pid=me.pid, pid_started=me.started, heartbeat=now - 3600)
    assert old.live(now)
    # Elsewhere, or a record without the identity: the heartbeat decides.
    elsewhere = replace(rec, process_table="another-boot/pid:[1]")
    assert elsewhere.live(now, stale_after_s=10) and not elsewhere.live(now + 11, stale_after_s=10)
    assert "has not written its status for 11s" in elsewhere.gone_reason(now + 11)
    assert replace(rec, pid_started=0).live(now, stale_after_s=10)


def test_a_role_ends_itself_when_its_supervisors_pipe_closes():
    role, took, _, err = _close_its_pipe(ROLE, bound_s=PEER_LINGER_S + 3, open_s=PEER_LINGER_S + 1)
    assert role.returncode == EXIT_SUPERVISOR_GONE and PEER_LINGER_S - 0.5 <= took, took
    assert "the supervisor is gone (its standard input" in err


def test_a_role_that_still_serves_lingers_until_idle():
    # Busy for BUSY_S after its pipe closes (a server rank 0 still pushes to), then idle.
    role, took, _, _ = _close_its_pipe(BUSY, bound_s=15.0)
    assert role.returncode == EXIT_SUPERVISOR_GONE and BUSY_S <= took < BUSY_S + 3, took


def test_a_role_ends_itself_when_its_supervisor_is_killed(tmp_path):
    # A supervisor process that starts the role the way the local backend does, then waits.
    supervisor_code = textwrap.dedent(f"""
        import os, subprocess, sys
        from common.procs.identity import ProcessIdentity
        from common.procs.watchdog import supervised_by
        role = subprocess.Popen([sys.executable, "-c", {ROLE!r}], start_new_session=True,
                                env={{**os.environ, **supervised_by(ProcessIdentity.of())}},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert role.stdout.readline().strip() == "ready"
        print(role.pid, flush=True)
        import time; time.sleep(120)
    """)
    sup = subprocess.Popen([sys.executable, "-c", supervisor_code], env=_env(), stdout=subprocess.PIPE, text=True,
                           cwd=ROOT)
    role = None
    try:
        role = psutil.Process(int(sup.stdout.readline()))
        identity = ProcessIdentity.of(role.pid)
        assert not ends_itself(role.pid)  # its supervisor runs: a stop must signal it
        sup.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        sup.wait(timeout=30)
        assert ends_itself(role.pid)  # ending itself: worth waiting for, not signalling
        # Within 5 s of the kill: a watch interval, then the peers' linger (a zombie has exited).
        while identity.running() and time.monotonic() - killed < 5.0:
            time.sleep(0.05)
        assert not identity.running(), f"the role still runs {time.monotonic() - killed:.1f}s after its supervisor"
    finally:
        sup.kill()
        sup.wait(timeout=30)
        if role is not None and role.is_running():
            role.kill()


def test_the_checkpoint_writer_is_preempted_at_once():
    role, took, out, err = _close_its_pipe(WRITER, bound_s=5.0)
    assert role.returncode == 75 and took < PEER_LINGER_S, took
    assert out.strip() == "preempted"
    assert "preempting this role (emergency checkpoint, grace 30s)" in err


def test_no_watch_without_the_variable_and_a_clear_error_for_a_bad_one():
    assert watch_supervisor({}) is None
    with pytest.raises(ValueError, match="TABLE PID START_TICKS"):
        watch_supervisor({SUPERVISOR_ENV: "12345"})
    with pytest.raises(ValueError, match="not a process of this machine's table"):
        watch_supervisor({SUPERVISOR_ENV: f"another-boot/pid:[1] {os.getpid()} 1"})
    assert supervised_by(None) == {SUPERVISOR_ENV: STDIN}
    me = ProcessIdentity.of()
    assert supervised_by(me) == {SUPERVISOR_ENV: me.to_text()}
    assert supervised_by(replace(me, table="")) == {}  # a machine without /proc: nothing to watch by


def test_a_stop_waits_for_roles_ending_themselves_instead_of_signalling_them(tmp_path):
    from common.procs import kill_recorded

    # A supervisor that records its role as the clusters do; the role notes any SIGTERM it gets.
    marker = tmp_path / "terminated"
    role_code = (f"import signal; signal.signal(signal.SIGTERM, lambda *a: open({str(marker)!r}, 'w').close()); "
                 + ROLE)
    supervisor_code = textwrap.dedent(f"""
        import os, sys
        from common.procs import GroupSpawner
        from common.procs.identity import ProcessIdentity
        from common.procs.watchdog import supervised_by
        role = GroupSpawner({str(tmp_path / "procs")!r}).spawn(
            "worker-1", [sys.executable, "-c", {role_code!r}], {{**os.environ, **supervised_by(ProcessIdentity.of())}})
        assert role.stdout.readline().strip() == "ready"
        print("started", flush=True)
        import time; time.sleep(120)
    """)
    sup = subprocess.Popen([sys.executable, "-c", supervisor_code], env=_env(), stdout=subprocess.PIPE, text=True,
                           cwd=ROOT)
    try:
        assert sup.stdout.readline().strip() == "started"
        sup.kill()
        sup.wait(timeout=30)
        started = time.monotonic()
        assert kill_recorded(str(tmp_path / "procs"), grace_s=0.5, wait_s=15.0) == ["worker-1"]
        took = time.monotonic() - started
    finally:
        sup.kill()
        sup.wait(timeout=30)
        kill_recorded(str(tmp_path / "procs"), grace_s=0.5)
    assert PEER_LINGER_S - 1.5 <= took < 10.0, took  # it ended itself, well within the wait
    assert not marker.exists()  # and was never signalled


def test_a_role_apart_from_its_supervisor_watches_the_status_record(tmp_path):
    """``ec2``: SSM starts a role on another instance than its supervisor, so it reads the job's
    status record (here a local file this test writes as the supervisor would): no record judges
    nothing, fresh heartbeats keep it running, and once they stop it is gone within
    ``RECORD_STALE_S`` and a read; another supervisor's record ends it at once."""
    import threading

    from common.procs.watchdog import RECORD_STALE_S, WATCH_INTERVAL_S, supervised_by_record
    from training.launch.status import StatusWriter

    me = ProcessIdentity.of()  # this test plays the supervisor
    uri = str(tmp_path / "job_status.json")

    def role():
        return subprocess.Popen([sys.executable, "-c", ROLE], env=_env(**supervised_by_record(uri, me)),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT)

    first = role()
    try:
        assert first.stdout.readline().strip() == "ready"
        time.sleep(2 * WATCH_INTERVAL_S)
        assert first.poll() is None  # no record yet (or storage trouble): nothing judged
        writer = StatusWriter(uri, JobStatus(state=RUNNING, job_id="j", pid=me.pid, process_table=me.table,
                                             pid_started=me.started), heartbeat_s=0.5)
        stop = threading.Event()

        def beat_until_stopped():
            while not stop.wait(0.2):
                writer.beat()

        beats = threading.Thread(target=beat_until_stopped)
        beats.start()
        time.sleep(RECORD_STALE_S + 2 * WATCH_INTERVAL_S)
        assert first.poll() is None  # heartbeats fresh: alive
        stop.set()
        beats.join()
        last_beat = time.monotonic()
        first.wait(timeout=RECORD_STALE_S + WATCH_INTERVAL_S + PEER_LINGER_S + 5)
        gone_after = time.monotonic() - last_beat
        assert first.returncode == EXIT_SUPERVISOR_GONE
        err = first.stderr.read()
        assert "the supervisor is gone (its heartbeat in" in err, err
        # Seen within the stale bound and a read, then the peers' linger (PEER_LINGER_S, idle).
        assert gone_after <= RECORD_STALE_S + WATCH_INTERVAL_S + PEER_LINGER_S + 1.5, gone_after

        other = replace(writer.status, pid=me.pid + 1)
        (tmp_path / "job_status.json").write_bytes(replace(other, heartbeat=time.time()).to_json())
        second = role()
        second.wait(timeout=WATCH_INTERVAL_S + PEER_LINGER_S + 5)
        assert second.returncode == EXIT_SUPERVISOR_GONE and "names another supervisor" in second.stderr.read()
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
