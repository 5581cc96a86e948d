"""Airflow-facing pieces of the pipeline. Modules here import Airflow and the layers below
(training, data_checks, infra), never the other way round; heavy packages are imported inside
functions so DAG files that import from here stay cheap to parse.

- ``training_dag``: the training DAG's definition, built from explicit arguments.
- ``pipeline_tasks``: what each task of the training DAG does, in Airflow's terms.
- ``sweep_dag``: the hyperparameter sweep DAG's definition, from the training DAG's task factories.
- ``sweep_tasks``: what the sweep DAG's own tasks do (plan the trials, select the best one).
- ``sweep_gate``: a sweep trial's gate: it holds the trial until the run's ``sweep.parallel`` lets it take a cluster.
- ``params``: the training DAG's trigger form: typed, bounded, described ``Param``s.
- ``run_config``: a training run's config from the DAG's Params, in layers.
- ``train_operator``: the training task: a durable, deferrable operator around a detached supervisor.
- ``train_trigger``: the trigger the training operator defers to; it polls the job's status record.
- ``review_tasks``: what each task of the model-review DAG does.
- ``score_tasks``: what each task of the batch-scoring DAG does.
- ``failures``: ``fail_without_retry``, the one way a task fails without using its retries.
- ``approval``: Airflow's ``ApprovalOperator``, with the reviewer's answer kept on Reject too.
- ``assets``: the pipeline's Airflow Assets, for lineage and data-aware scheduling.
- ``callbacks``: task callbacks: one log line per failure or retry.
- ``connections``: the deployment's S3 and MLflow Connections and cluster Variables, for the layers below.
- ``links``: the "MLflow run" extra link on the training DAG's train and register tasks.

The tasks are thin: ``pipeline_tasks`` (the training DAG) and ``review_tasks`` (the review DAG)
and ``score_tasks`` (the batch-scoring DAG)
turn Params and XComs into a call of the layer below, and its deterministic errors into
``failures.fail_without_retry`` (no retry).
"""
