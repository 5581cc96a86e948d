"""Which process table a pid belongs to, and whether a recorded process is still running there.

A pid says nothing on its own: another machine, another container (a pid namespace of its own)
or a later process that got the same pid after ours exited all show the same number. A
``ProcessIdentity`` is therefore the pid, its start time (``groups.start_time``: clock ticks
since boot, from psutil's ``create_time``) and the process table it lives in
(``process_table()``: the kernel's boot id and the pid namespace's inode). A process whose
table is this one can be inspected here (``running``) and is known dead the moment it is gone;
anything else (another host, another container, a machine without ``/proc``) can only be
judged by the caller's other means (a heartbeat).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from common.procs.groups import is_running, start_time

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_PID_NS = "/proc/self/ns/pid"


@functools.cache
def process_table() -> str:
    """This process's process table: ``<boot id>/<pid namespace>``; empty where Linux's /proc
    cannot say (then no recorded pid is ever judged from here)."""
    try:
        with open(_BOOT_ID) as fh:
            boot = fh.read().strip()
        namespace = os.readlink(_PID_NS)  # "pid:[4026531836]": same inode, same table
    except OSError:
        return ""
    return f"{boot}/{namespace}" if boot and namespace else ""


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, told apart from a later one with the same pid and from other machines'."""

    table: str
    pid: int
    started: int

    @classmethod
    def of(cls, pid: int | None = None) -> "ProcessIdentity":
        """The identity of ``pid`` (default: this process), which must be running."""
        pid = os.getpid() if pid is None else pid
        started = start_time(pid)
        if started is None:
            raise ProcessLookupError(f"no process {pid}")
        return cls(process_table(), pid, started)

    @property
    def visible(self) -> bool:
        """True when this machine's process table is the one the process lives in."""
        return bool(self.table) and self.pid > 0 and self.table == process_table()

    def running(self) -> bool | None:
        """Whether the process is still running (not exited, its pid not reused); None when it
        cannot be seen from here (``visible`` is False)."""
        if not self.visible:
            return None
        return is_running(self.pid, self.started)

    def to_text(self) -> str:
        """``table pid started``: for an environment variable (the table holds no spaces)."""
        return f"{self.table} {self.pid} {self.started}"

    @classmethod
    def from_text(cls, text: str) -> "ProcessIdentity":
        try:
            table, pid, started = text.split(" ")
            return cls(table, int(pid), int(started))
        except ValueError:
            raise ValueError(f"a process identity is 'TABLE PID START_TICKS', got {text!r}") from None
