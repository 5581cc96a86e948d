"""Airflow-facing pieces of the pipeline. Modules here import Airflow and the layers below
(training, data_checks, infra), never the other way round; heavy packages are imported inside
functions so DAG files that import from here stay cheap to parse."""
