"""Where the MLflow tracking server is: the one resolver every task and CLI uses."""
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
