"""Light helpers shared by training, data_checks and infra: storage I/O, artifact paths, config.

Nothing here imports Airflow, MXNet, MLflow or Great Expectations, so any layer may use it.

- ``cli``: what the project's command lines share: help with examples, bad input as one line.
- ``config``: the one typed config that flows end to end: DAG params → shard → train → register.
- ``errors``: error kinds shared across layers, and ``DeterministicError``: what a retry cannot help.
- ``events``: the role exit codes and the typed events a role logs for its supervisor's readers.
- ``fpmode``: flush denormal floats to zero in a role process (x86-64 FTZ and DAZ).
- ``job_log``: the training job's log shipped to storage in chunks, read back from there by any host.
- ``job_states``: the states of a job's status record, shared by the supervisor and role watchdogs.
- ``manifest``: the shard manifest, the one file that says which shard files exist.
- ``model_code``: a custom network's code travelling with its run: packed, staged, verified.
- ``mx``: the one place that imports mxnet.
- ``paths``: every artifact path as a function of run (or dataset) identity.
- ``preprocessing``: a manifest's table preprocessing record, as readers use it.
- ``procs``: everything process-level: process groups, their records, leftovers, ports, usage.
- ``record_codec``: the codec of shard records, shared by the sharder (writer) and the trainer (reader).
- ``roles``: the roles of one ps-lite job and the environment each is started with.
- ``settings``: every environment variable the project reads, in one typed place.
- ``sweep``: a hyperparameter sweep's trial configs and its pruning (ASHA) rule.
- ``storage``: all storage I/O (S3 and local folders) of the pipeline.
- ``task_metrics``: the metrics of each ``model.task`` and which way each is better.
- ``version``: the code version that trained a model (its MLflow run's git commit).
"""
