"""Airflow-facing pieces of the pipeline. Modules here import Airflow and the layers below
(training, data_checks, infra), never the other way round; heavy packages are imported inside
functions so DAG files that import from here stay cheap to parse.

The tasks are thin: ``pipeline_tasks`` (the training DAG) and ``review_tasks`` (the review DAG)
turn Params and XComs into a call of the layer below, and its deterministic errors into
``failures.fail_without_retry`` (no retry)."""
