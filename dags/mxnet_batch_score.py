"""Batch scoring with the champion: a table (a file, a glob or a folder; CSV or Parquet; S3 or
local), larger than memory, scored with ``models:/<name>@champion`` or a version the user names.

resolve (model version, training manifest, input files and fingerprint, schema check) →
needs_scoring (a committed output of this input and version is reused unless ``rescore``) →
check (drift against the train statistics, rows per part) → score_part (mapped: one task per
part of the input, read in chunks) → finish (output manifest: model version, run id, input
fingerprint, parts with sha256; a rescore must reproduce the committed bytes).

Output: Parquet predictions (the id column of the training config, else ``row``: the row's
position in the input; then ``label`` and ``probability``, or one column per regression target)
under ``{MXPIPE_ARTIFACT_ROOT}/scores/{model}/v{version}/{input fingerprint}-{layout}/``, each run's
parts under ``runs/{run id}/``, the first finished run's manifest at ``manifest.json``.

Triggered by hand (Params below) or by an event on the Asset ``x-mxpipe://score-input/landed``
(``plugins.assets.SCORE_INPUT``) whose extra names the input: ``{"input_uri": ...}``,
optionally ``model_name`` and ``version``. The tasks are ``plugins.score_tasks``.
"""
from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, dag, get_current_context, task

from common.settings import DEFAULT_MODEL_NAME
from plugins import score_tasks
from plugins.assets import SCORE_INPUT
from plugins.connections import with_connections

PARAMS = {
    "input_uri": Param("", type="string", description="The table to score: a file, a glob (s3://b/in/part-*.parquet) "
                                                      "or a folder ending in '/'; empty: the asset event's input_uri."),
    "model_name": Param(DEFAULT_MODEL_NAME, type="string", pattern=r"^[A-Za-z0-9_.-]{1,100}$",
                        description="Registered model (an asset event's model_name wins)."),
    "version": Param("", type="string", pattern=r"^[0-9]*$",
                     description="Model version; empty: the version with alias 'champion'."),
    "drift": Param(score_tasks.DEFAULT_DRIFT, **score_tasks.DRIFT_SCHEMA,
                   description="Refuse the input when a numeric column's mean is more than max_mean_shift train "
                               "std from the train mean, its std more than max_std_ratio times (or less than "
                               "1/max_std_ratio) the train std, or a categorical column has more than "
                               "max_unseen_share of values the train split never had."),
    "chunk_rows": Param(score_tasks.DEFAULT_CHUNK_ROWS, type="integer", minimum=100, maximum=5_000_000,
                        description="Rows held in memory at once (one row group of the output)."),
    "part_rows": Param(score_tasks.DEFAULT_PART_ROWS, type="integer", minimum=1000,
                       description="Rows per mapped scoring task, for Parquet input (a CSV file is one task)."),
    "rescore": Param(False, type="boolean",
                     description="Score again even if this input and version were scored; the new output must "
                                 "be byte-identical to the committed one."),
}


CHECKS_KEY = "checks"  # the check task's outcome (drift summary, profile, rows) as a keyed XCom


def _ids() -> tuple[str, str]:
    ctx = get_current_context()
    return ctx["dag"].dag_id, ctx["run_id"]


@dag(
    dag_id="mxnet_batch_score",
    schedule=[SCORE_INPUT],
    catchup=False,
    max_active_runs=2,
    params=PARAMS,
    tags=["mxnet", "mlflow", "scoring"],
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
    doc_md=__doc__,
)
def mxnet_batch_score() -> None:
    @task(execution_timeout=timedelta(minutes=10))
    @with_connections
    def resolve(params: dict | None = None) -> dict:
        ctx = get_current_context()
        return score_tasks.resolve(params, ctx.get("triggering_asset_events"), *_ids())

    # False (already scored, no rescore) skips every task after it.
    @task.short_circuit(execution_timeout=timedelta(minutes=1))
    def needs_scoring(target: dict) -> bool:
        return score_tasks.needs_scoring(target)

    # Returns the parts (what score_part maps over: Airflow maps over a return value only); the
    # checks' outcome goes to finish as a keyed XCom.
    @task(execution_timeout=timedelta(hours=2))
    @with_connections
    def check(target: dict) -> list:
        checked = score_tasks.check(target)
        get_current_context()["ti"].xcom_push(key=CHECKS_KEY, value=checked["checks"])
        return checked["parts"]

    # Each mapped task is named by its file (and row groups) in the UI.
    @task(execution_timeout=timedelta(hours=2), map_index_template="{{ part_name }}")
    @with_connections
    def score_part(target: dict, part: dict) -> dict:
        get_current_context()["part_name"] = score_tasks.part_label(part)  # type: ignore[typeddict-unknown-key]
        return score_tasks.score_part(target, part)

    @task(execution_timeout=timedelta(minutes=10))
    @with_connections
    def finish(target: dict, results: list) -> dict:
        checks = get_current_context()["ti"].xcom_pull(task_ids="check", key=CHECKS_KEY)
        return score_tasks.finish(target, checks, results, *_ids())

    target = resolve()
    parts = check(target)
    needs_scoring(target) >> parts
    finish(target, score_part.partial(target=target).expand(part=parts))


mxnet_batch_score()
