"""The training loop of one worker role and everything a step needs.

Owns: the worker's ``run`` (set up → resume → steps → export, ``worker``), where a run starts
and what a checkpoint records of its position (checkpoint, elastic, warm start: ``resume``), one
optimizer step (``step``), the optimizer and learning-rate schedule (``optim``), kvstore views and
trainer construction (``kvstore_sync``), split (model-parallel) placement (``placement``), the
model zoo and the dispatch to a custom network's factory (``model``, ``custom_model``), throughput and per-step records (``metrics``) and test fault injection,
read from the environment once (``faults``). May import ``common``, ``training.feed``,
``training.checkpoint`` and ``training.launch.job`` (the job spec and exit codes a role shares
with its supervisor); never ``training.tracking`` (no MLflow in a role process) nor
``training.launch``'s supervisor.
"""
