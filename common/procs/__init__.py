"""Everything process-level, on psutil: every long-lived child we start gets a session of its
own, and is stopped by signalling the whole group (servers such as MLflow or an MXNet role may
fork helpers that would outlive a plain ``kill pid``).

- ``groups``: start-time identity (a recycled pid is never mistaken for ours), group and session
  membership, environment tags, and ``stop_groups``, the one SIGTERM → grace → SIGKILL
  escalation, used for role groups and services alike.
- ``records``: ``GroupRecord``, one started group (a role's, or a service's with its log, port
  and pid file) and how it is stopped; ``GroupSpawner``, which records the groups it starts so a
  different process (an Airflow teardown task, a reaper) can stop them later; ``exec_role`` for
  another host.
- ``leftovers``: ``Watch``, the proof that a run left no process running.
- ``identity``: ``ProcessIdentity`` (process table, pid, start time): whether a recorded
  process, such as a job's supervisor, is still running, judged on its own machine only.
- ``watchdog``: a role's watch on its supervisor (``watch_supervisor``): a role exits on its
  own once its supervisor is gone (rank 0 after its emergency checkpoint).
- ``spot``: a role's watch for its spot instance's interruption notice (``watch_spot``, on when
  ``MXPIPE_SPOT_WATCH`` is set): one ``SpotInterruption`` event line on the role's output.
- ``ports``: ``free_port``.
- ``limits``: ``raise_open_files_limit``, which every role and the supervisor call as they start
  (ps-lite connects every role to every other one).
- ``usage``: what process trees consume (core-seconds, CPU %, resident memory), per named tree.
- ``__main__``: ``python -m common.procs``, the host-side helpers below.

The same records work on another host: ``python -m common.procs exec-role --record F -- ARGV``
makes the role lead its own group, writes its record and ``exec``s the role (same pid), and
``python -m common.procs kill-records DIR`` stops them, both run through a cluster's transport
(ssh, ``ip netns exec``, SSM).
"""
from common.procs.groups import (
    group_members,
    is_running,
    kill_groups,
    start_time,
    still_ours,
    stop_groups,
    tagged_processes,
)
from common.procs.leftovers import LeftBehind, Watch
from common.procs.ports import free_port, port_is_free
from common.procs.records import GroupRecord, GroupSpawner, ProcessRole, kill_recorded

__all__ = [
    "GroupRecord", "GroupSpawner", "LeftBehind", "ProcessRole", "Watch", "free_port", "group_members",
    "is_running", "kill_groups", "kill_recorded", "port_is_free", "start_time", "still_ours",
    "stop_groups", "tagged_processes",
]
