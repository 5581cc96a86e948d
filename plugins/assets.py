"""Airflow Assets of the training pipeline, for lineage and data-aware scheduling.

``source_dataset`` is the table the retraining DAG reads (``MXPIPE_DATASET_URI``); a DAG that
lands new data there declares it as an outlet (see ``dags/dataset_landed.py``), and that
triggers a retraining run; ``score_input`` is a table to score landing, which triggers a
batch-scoring run (``dags/mxnet_batch_score.py``). ``shards`` and ``model`` are what a training run produces; their
static URIs (``x-mxpipe://…``, see ``_uri``) name the collection, and each run attaches its concrete location (shards prefix,
manifest digest, model version) as the asset event's ``extra``. Read from the settings once,
at parse time: nothing heavy is imported.
"""
from __future__ import annotations

from airflow.sdk import Asset

from common import storage
from common.paths import DATASETS_DIR
from common.settings import DEFAULT_MODEL_NAME, settings


def _uri(kind: str, location: str) -> str:
    """``x-mxpipe://{kind}/{location without scheme}``.

    An "x-" scheme is one Airflow does not normalise: an ``s3://`` (or any provider-known)
    asset URI makes Airflow load every provider's URI handlers at parse time, and the Amazon
    one imports boto3 (measured: a parse-time import the DAG files must not have).
    """
    return f"x-mxpipe://{kind}/{location.split('://', 1)[-1].lstrip('/')}"


_SETTINGS = settings()
SOURCE_DATASET = Asset(name="mxpipe.source_dataset", uri=_uri("dataset", _SETTINGS.dataset_uri), group="dataset")
SHARDS = Asset(name="mxpipe.shards", uri=_uri("shards", storage.join(_SETTINGS.artifact_root, DATASETS_DIR)),
               group="dataset")
MODEL = Asset(name="mxpipe.model", uri=_uri("model", DEFAULT_MODEL_NAME), group="model")
# "A table to score has landed": triggers ``mxnet_batch_score``. Static, like the others; the
# event's extra names the data (``{"input_uri": ...}``, optionally ``model_name``, ``version``):
# posted through the API by an upload job, or by an upstream task with this Asset as its outlet.
SCORE_INPUT = Asset(name="mxpipe.score_input", uri=_uri("score-input", "landed"), group="dataset")


def check_landed(uri: str) -> dict[str, object]:
    """What a "dataset landed" event carries: the source exists (a folder or glob: some file
    under it does), with its URI, so the retraining run it triggers has something to read."""
    if "*" in uri or uri.endswith("/"):
        base = uri.split("*", 1)[0].rsplit("/", 1)[0]
        found = next(iter(storage.list_uris(base)), None) is not None
    else:
        found = storage.exists(uri)
    if not found:
        from plugins.failures import fail_without_retry

        raise fail_without_retry(f"dataset landed: nothing at {uri}; no asset event is emitted")
    return {"dataset_uri": uri}
