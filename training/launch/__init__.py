"""Starting and supervising a job: the job spec, the role launcher and the supervisor.

Owns: ``JobSpec`` and the exit-code contract between roles and their supervisor (``job``),
and the ``Supervisor`` that starts scheduler, servers and workers through a cluster's
transport and ends the whole job on the first failure, stall or timeout (``launcher``), the
job's status record (``status``) and the supervisor as a command of its own, started detached
by a cluster (``supervise``). May
import ``common``; never ``training.loop`` (roles are separate processes, started by command
line) nor ``training.tracking``.
"""
