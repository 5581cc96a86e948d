"""The training loop of one worker role and everything a step needs.

Owns: the worker's ``run`` and its loop (set up → resume → steps → export: ``worker``), rank 0's
validation at an epoch end (``evaluation``), SIGTERM handling between steps with the emergency
checkpoint and exit code (``preemption``), the model export and the best epoch's parameters for it
(``export``), the best epoch, patience and the workers' shared stop decision (``early_stop``),
where a run starts and what a checkpoint records of its position (checkpoint, elastic, warm
start: ``resume``), one optimizer step (``step``), the optimizer and learning-rate schedule
(``optim``), kvstore views and trainer construction (``kvstore_sync``), split (model-parallel)
placement (``placement``), the model zoo and the dispatch to a custom network's factory
(``model``, ``custom_model``), throughput and per-step records (``metrics``) and test fault
injection, read from the environment once (``faults``). The loop's events (``common.events``)
are its contract with the supervisor's readers.

May import ``common``, ``training.feed``, ``training.checkpoint`` and ``training.launch.job`` (the
job spec a role shares with its supervisor); never ``training.tracking`` (no MLflow in a role
process) nor ``training.launch``'s supervisor.
"""
