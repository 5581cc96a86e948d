"""Starting and supervising a job: the job spec, the role launcher and the supervisor.

- ``job``: ``JobSpec`` and the exit-code contract between roles and their supervisor.
- ``launcher``: the ``Supervisor`` that starts scheduler, servers and workers through a cluster's
  transport, restarts every role in place after a failure or stall, and ends the job when a
  restart cannot help.
- ``restarts``: the budget of in-place restarts (failures without progress).
- ``status``: the job's status record.
- ``supervise``: the supervisor as a command of its own, started detached by a cluster.
- ``detached``: running a job that way and waiting on it (the one way a job runs, for the CLI,
  the tests and the benchmarks).

May import ``common``; never ``training.loop`` (roles are separate processes, started by command
line) nor ``training.tracking``.
"""
