"""Light helpers shared by training, data_checks and infra: storage I/O, artifact paths.

Nothing here imports Airflow, MXNet, MLflow or Great Expectations, so any layer may use it.
"""
