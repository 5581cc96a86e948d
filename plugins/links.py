""""MLflow run" extra link on the training DAG's train and register tasks.

TaskFlow tasks are not operator classes a plugin's ``operator_extra_links`` can name, so the link
is registered globally (``global_operator_extra_links``) and resolves only on those two tasks;
elsewhere it is empty (the UI greys it out). Both point at the DAG run's one MLflow run, whose
URL the register task returns in its XCom (``run_url``); before that, while the job trains, the
train task's ``mlflow_run_url`` XCom, pushed as soon as its live run exists
(``training.tracking.live``). Resolved by the API server, so it reads the XCom table directly.
"""
from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink

LINKED_TASKS = ("train", "register")
REGISTER_TASK = "register"
TRAIN_TASK = "train"


def _xcom(dag_id: str, run_id: str, task_id: str, key: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.execute(XComModel.get_many(run_id=run_id, key=key, task_ids=task_id,
                                                 dag_ids=dag_id, limit=1).with_only_columns(XComModel.value)
                              ).first()
    return XComModel.deserialize_value(row) if row is not None else None


def register_xcom(dag_id: str, run_id: str) -> Any:
    """The register task's return value for one DAG run (None before it has succeeded)."""
    return _xcom(dag_id, run_id, REGISTER_TASK, "return_value")


def live_run_url(dag_id: str, run_id: str) -> str:
    """The URL the train task pushed once its live MLflow run existed ("" before)."""
    from plugins.pipeline_tasks import LIVE_RUN_XCOM_KEY

    value = _xcom(dag_id, run_id, TRAIN_TASK, LIVE_RUN_XCOM_KEY)
    return value if isinstance(value, str) else ""


class MlflowRunLink(BaseOperatorLink):
    name = "MLflow run"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        if operator.task_id not in LINKED_TASKS:
            return ""
        value = register_xcom(ti_key.dag_id, ti_key.run_id)
        if isinstance(value, dict) and value.get("run_url"):
            return str(value["run_url"])
        return live_run_url(ti_key.dag_id, ti_key.run_id)


class MxpipeLinksPlugin(AirflowPlugin):
    name = "mxpipe_links"
    global_operator_extra_links = [MlflowRunLink()]
