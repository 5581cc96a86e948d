"""Task callbacks: one log line per failure or retry, so the cause is greppable without opening
every attempt's log. Wired through the training DAG's ``default_args``."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("mxpipe.callbacks")


def summary(event: str, context: Any) -> str:
    """``<event>: dag=… task=… run=… attempt=N/M why=<Type>: <first line>``."""
    ti = context["ti"]
    exc = context.get("exception")
    why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}" if exc else "unknown"
    task = ti.task_id if getattr(ti, "map_index", -1) in (-1, None) else f"{ti.task_id}[{ti.map_index}]"
    retries = getattr(context.get("task"), "retries", None)
    attempts = "" if retries is None else f"/{retries + 1}"
    return (f"{event}: dag={ti.dag_id} task={task} run={ti.run_id} attempt={ti.try_number}{attempts} "
            f"why={why[:500]}")


def on_failure(context: Any) -> None:
    log.error("%s", summary("task failed", context))


def on_retry(context: Any) -> None:
    log.warning("%s", summary("task up for retry", context))
