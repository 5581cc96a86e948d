"""Model review: champion vs challenger on the same held-out set, then a human decision.

resolve → compare (both versions loaded through mlflow.pyfunc and scored with
mlflow.models.evaluate on the challenger's test split; the comparison goes to an MLflow review
run and the task log) → gate (the challenger's metrics against the ``gate`` Param's thresholds
and the champion's; a failure tags the version ``review=gate_failed`` with the reason in
``review.gate`` and skips everything after it: no reviewer is asked, and the run ends
*success* with ``gate`` returning False and approval/promote/reject skipped) → approval
(Airflow's ApprovalOperator; the version's model card summary, the comparison and the gate's
table are its body; the gate task logs the card with its result, ``training.tracking.model_card``)
→ promote (on Approve: the ``champion`` alias moves to the version) / reject (on Reject: the version is
tagged ``review=rejected`` with the reviewer's comment; the aliases stay).

Triggered by the Asset ``x-mlflow://models/<name>`` (``plugins.review_tasks.model_asset``) of each
model in ``MXPIPE_REVIEW_MODELS`` (default ``digits-classifier``): the training DAG's ``register``
task emits it through the AssetAlias ``mxpipe.registered_model`` with
``extra={"registered_model_name": ..., "version": ...}``, and ``resolve`` reviews the version that
event names.
Or by hand, with the Params below. No answer within ``MXPIPE_REVIEW_TIMEOUT_H`` hours (default
72) fails the approval task and changes nothing; a new manual run asks again.
"""
from __future__ import annotations

from datetime import timedelta

from airflow.sdk import AssetAny, Param, dag, get_current_context, task

from common.settings import settings
from plugins import review_tasks
from plugins.approval import DECISION_KEY, RecordedApprovalOperator

GATE_KEY = "gate"  # the gate's outcome (table, reason) as an XCom of the gate task
RESPONSE_TIMEOUT = timedelta(hours=settings().review_timeout_h)

PARAMS = {
    "model_name": Param(review_tasks.review_models()[0], type="string", pattern=r"^[A-Za-z0-9_.-]{1,100}$",
                        description="Registered model to review (ignored when an Asset event names one)."),
    "version": Param("", type="string", pattern=r"^[0-9]*$",
                     description="Version to review; empty: the version with alias 'challenger'."),
    "shards_prefix": Param("", type="string", pattern=r"^(|(s3://|/).+)$",
                           description="Test data (a shards prefix); empty: the version's "
                                       "'dataset.shards_prefix' tag."),
    "gate": Param(review_tasks.DEFAULT_GATE, **review_tasks.GATE_SCHEMA,
                  description="Automatic gate before the reviewer (left at this default, a regression model "
                              "gets root_mean_squared_error, at most 1 % above the champion's): "
                              "{metric: {greater_is_better, threshold, "
                              "min_absolute_change, min_relative_change, max_absolute_drop, max_relative_drop}} "
                              "(metrics as mlflow.models.evaluate names them). threshold is a floor; min_* a "
                              "required gain over the champion; max_* a tolerated loss. With no champion only "
                              "threshold applies."),
}


def _ids() -> tuple[str, str]:
    ctx = get_current_context()
    return ctx["dag"].dag_id, ctx["run_id"]


@dag(
    dag_id="model_review",
    schedule=AssetAny(*(review_tasks.model_asset(name) for name in review_tasks.review_models())),
    catchup=False,
    # Reviews may wait for days; a few can wait side by side, each for its own version.
    max_active_runs=3,
    params=PARAMS,
    tags=["mxnet", "mlflow", "review"],
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
    doc_md=__doc__,
)
def model_review() -> None:
    # A bad name/version fails at once (AirflowFailException); the retry is for MLflow hiccups.
    @task(execution_timeout=timedelta(minutes=5))
    def resolve(params: dict | None = None) -> dict:
        return review_tasks.resolve(params, get_current_context().get("triggering_asset_events"))

    @task(execution_timeout=timedelta(minutes=30))
    def compare(target: dict) -> dict:
        return review_tasks.compare(target, *_ids())

    # False (failed) skips every task after it, whatever its trigger rule: reject too.
    @task.short_circuit(execution_timeout=timedelta(minutes=5))
    def gate(target: dict, reviewed: dict, params: dict | None = None) -> bool:
        outcome = review_tasks.gate(target, reviewed, params["gate"])
        get_current_context()["ti"].xcom_push(key=GATE_KEY, value=outcome)
        return outcome["passed"]

    approval = RecordedApprovalOperator(
        task_id="approval",
        subject="Promote {{ ti.xcom_pull(task_ids='resolve')['name'] }} version "
                "{{ ti.xcom_pull(task_ids='resolve')['challenger'] }} to champion?",
        # The model card's summary first: the reviewer decides from it (the full card is linked).
        body="{{ ti.xcom_pull(task_ids='gate', key='" + GATE_KEY + "')['card'] }}\n\n"
             "{{ ti.xcom_pull(task_ids='compare')['markdown'] }}\n\n"
             "{{ ti.xcom_pull(task_ids='gate', key='" + GATE_KEY + "')['markdown'] }}",
        params={"comment": Param("", type="string", description="Why (kept as a tag on the version).")},
        response_timeout=RESPONSE_TIMEOUT,
        # Bounds the write of the request, not the human wait (response_timeout does that).
        execution_timeout=timedelta(minutes=5),
        retries=0,  # a retry would ask again: a timeout is an answer ("not now")
    )

    @task(execution_timeout=timedelta(minutes=5))
    def promote(target: dict, reviewed: dict, decision: dict) -> dict:
        return review_tasks.apply_approval(target, reviewed, decision)

    # The operator skips its direct downstream (promote) on Reject. This task hangs off promote
    # with all_skipped, so it runs exactly then; its inputs are pulled, not passed, because an
    # XCom argument would make resolve/compare/approval upstreams and they never skip.
    @task(trigger_rule="all_skipped", execution_timeout=timedelta(minutes=5))
    def reject() -> dict:
        ti = get_current_context()["ti"]
        return review_tasks.apply_rejection(ti.xcom_pull(task_ids="resolve"), ti.xcom_pull(task_ids="compare"),
                                     ti.xcom_pull(task_ids="approval", key=DECISION_KEY))

    target = resolve()
    reviewed = compare(target)
    gate(target, reviewed) >> approval
    promote(target, reviewed, approval.output) >> reject()


model_review()
