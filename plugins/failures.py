"""How a task fails when a retry cannot help: the one helper every task module raises with.

Bad input, a failed data check, an invalid config or cluster settings, a missing connection, a
warm start naming nothing usable, a NaN loss: the same input fails the same way, so these raise
``AirflowFailException`` (no retry). Anything else raises as it is and Airflow retries the task.
"""
from __future__ import annotations


def fail_without_retry(message: str) -> Exception:
    """The exception that fails the task at once, without a retry (raise it, ``from`` the cause)."""
    from airflow.sdk.exceptions import AirflowFailException

    return AirflowFailException(message)
