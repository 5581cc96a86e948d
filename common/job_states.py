"""The states of a job's status record (``training.launch.status``), named here so that a role's
watchdog (``common.procs.watchdog``), which must not import the training package, reads the
same names the supervisor writes."""
from __future__ import annotations

STARTING, RUNNING, SUCCEEDED, FAILED, STOPPED = "starting", "running", "succeeded", "failed", "stopped"
STATES = (STARTING, RUNNING, SUCCEEDED, FAILED, STOPPED)
ACTIVE_STATES = frozenset({STARTING, RUNNING})
FINAL_STATES = frozenset({SUCCEEDED, FAILED, STOPPED})
