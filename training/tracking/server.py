"""Where the MLflow tracking server is: the one resolver every task and CLI uses.

It reads the environment only. In Airflow, a task has applied its MLflow connection
(``mlflow_default``, or the one the run's ``mlflow_conn_id`` Param names) to its own environment
before it gets here (``plugins.connections``): the server as ``MLFLOW_TRACKING_URI``, its token or
basic auth as ``MLFLOW_TRACKING_TOKEN`` / ``_USERNAME`` / ``_PASSWORD``, which MLflow's client
reads on every request. Without a connection (a shell, or a deployment that sets the variables),
the environment is what it was.
"""
from __future__ import annotations

from common.settings import settings


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, or where it is unset or empty, what MLflow resolves itself (a URI
    set in this process, else its local default store)."""
    uri = settings().mlflow_tracking_uri
    if uri:
        return uri
    import mlflow  # only here: it takes seconds to import

    return mlflow.get_tracking_uri()
