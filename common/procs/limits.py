"""The open-files limit a role raises for itself as it starts.

ps-lite's ZMQ van connects every node of a job to every other node: measured on the local backend
(``benchmarks/many_roles.py``), the busiest scheduler or server of a job of 33 processes (24
workers, 8 servers) holds 110 file descriptors (67 TCP sockets) and a worker 42; at 9 processes,
38 and 24. A role's descriptors grow with the job (the job's in all with its square), the
scheduler's by about 3.3 a role, so at the 1024 soft limit most Linux hosts give a process, a job
of about 300 roles has its scheduler run out (``EMFILE``) and the rendezvous never ends, which the
supervisor sees only as workers that never started (tests/integration/test_many_roles.py shows it
at 10 processes under a soft limit of 32). The hard limit is usually far higher (524288 under
systemd): every role, and the supervisor (one pipe per role), raises its soft limit to it before
anything opens a connection. Raising a soft limit up to the hard one needs no privilege.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

# Linux's default ceiling for a process's descriptors (/proc/sys/fs/nr_open): the soft limit a
# process may take when its hard limit is unlimited (setrlimit refuses anything above nr_open).
_NR_OPEN = "/proc/sys/fs/nr_open"
_NR_OPEN_DEFAULT = 1 << 20


def _nr_open() -> int:
    try:
        with open(_NR_OPEN) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return _NR_OPEN_DEFAULT


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (children inherit it);
    the soft limit in force afterwards. Where the system refuses, the limit stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft
