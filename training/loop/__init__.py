"""The training loop of one worker role and everything a step needs.

- ``worker``: the worker's ``run`` and its loop (set up → resume → steps → export).
- ``validation``: rank 0's validation at an epoch end: one batch loop for every task.
- ``preemption``: SIGTERM between steps: the emergency checkpoint and the exit code.
- ``export``: the model export, and the best epoch's parameters for it.
- ``resume``: where a run starts and what a checkpoint records of its position (checkpoint,
  elastic, warm start).
- ``step``: one optimizer step.
- ``optim``: the optimizer and learning-rate schedule.
- ``kvstore_sync``: kvstore views and trainer construction.
- ``placement``: split (model-parallel) placement.
- ``model``: the model zoo and the dispatch to a custom network's factory.
- ``custom_model``: a network of the user's own (``package.module:factory``).
- ``metrics``: throughput and per-step records.
- ``early_stop``: the best epoch so far and when to stop on a validation metric.
- ``pruning``: a sweep trial's pruning at its rungs (asynchronous successive halving across trials).
- ``faults``: test fault injection, read from the environment once.

May import ``common``, ``training.feed``, ``training.checkpoint`` and ``training.launch.job``
(the job spec a role shares with its supervisor; the exit codes and events are
``common.events``); never ``training.tracking`` (no MLflow in a role process) nor
``training.launch``'s supervisor.
"""
