"""Batch scoring with a registered model: which version, where its output goes, how it is written.

- ``resolve_model``: ``models:/<name>@champion`` (or the version a user names) resolved once to
  a version number, its MLflow run and its training manifest (the version's
  ``dataset.shards_prefix`` tag, else the run's ``manifest.json`` artifact). Every later step
  loads ``models:/<name>/<version>``, never the alias again: a promotion during a run cannot
  mix two models in one output.
- ``output_prefix``: ``{root}/scores/{model}/v{version}/{input fingerprint[:16]}-{layout[:8]}``,
  the layout being the chunking (``chunk_rows``, ``part_rows``), which decides the row groups
  and so the bytes. Each run writes under ``runs/{run id}/`` of it (no run overwrites another's);
  the first run to finish commits ``manifest.json`` at the prefix itself (a conditional write),
  which is how a rerun finds the output.
- ``PartWriter``: one part's predictions as Parquet with fixed writer settings (``WRITER``): the
  same rows and model give the same bytes. pyarrow writes no timestamp into a Parquet file; the
  Arrow schema it stores is stripped of pandas' metadata (which would carry the frame's index
  layout), and ``created_by`` names the pyarrow version, recorded in the output manifest.
- ``predict_frame``: one chunk through the pyfunc model, keyed by the id column (or the row's
  position in the input).

mlflow, pandas and pyarrow are imported inside the functions.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from common.errors import DeterministicError
from training.tracking.review import CHAMPION_ALIAS, SHARDS_TAG
from training.tracking.runs import bounded_mlflow_env

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

SCORES_DIR = "scores"
MANIFEST_NAME = "manifest.json"
OUTPUT_FORMAT = 1
# The key column of a table without an id column: the row's position in the input (0-based,
# files in the listing's order).
ROW_COLUMN = "row"
# Fixed Parquet writer settings (pyarrow.parquet.ParquetWriter's keywords): nothing left to a
# default that a pyarrow upgrade could change silently.
WRITER: dict[str, Any] = {"version": "2.6", "compression": "zstd", "compression_level": 3, "use_dictionary": True,
                          "write_statistics": True, "data_page_version": "1.0", "store_schema": True,
                          "write_page_index": False, "write_page_checksum": False}


class ScoringError(DeterministicError):
    """The scoring cannot be done as asked (no such model or version, no training manifest, a
    rerun whose bytes differ from the committed output)."""


@dataclass(frozen=True)
class ScoringModel:
    name: str
    version: str
    run_id: str
    requested: str  # "@champion" or the version asked for
    shards_prefix: str | None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "uri": self.uri}


def resolve_model(tracking_uri: str, name: str, version: str | None) -> ScoringModel:
    """The version to score with: ``version``, else the one the ``champion`` alias names."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    what = f"{name} version {version}" if version else f"models:/{name}@{CHAMPION_ALIAS}"
    try:
        with bounded_mlflow_env():
            mv = client.get_model_version(name, version) if version else \
                client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise ScoringError(f"no registered model {what}: {exc.message}") from exc
        raise
    return ScoringModel(name, str(mv.version), mv.run_id or "", version or f"@{CHAMPION_ALIAS}",
                        mv.tags.get(SHARDS_TAG) or None)


def training_manifest(model: ScoringModel, tracking_uri: str, work_dir: str) -> tuple[dict[str, Any], str]:
    """The shard manifest the version was trained on and where it was read: the shards prefix of
    the version's tag, else the ``manifest.json`` its run logged."""
    from common.errors import DataError
    from common.manifest import load_manifest, manifest_uri

    if model.shards_prefix:
        try:
            return load_manifest(model.shards_prefix), manifest_uri(model.shards_prefix)
        except DataError as exc:
            log.warning("%s: %s; trying the run's manifest.json", model.uri, exc)
    if model.run_id:
        import mlflow.artifacts
        from mlflow.exceptions import MlflowException

        try:
            with bounded_mlflow_env():
                path = mlflow.artifacts.download_artifacts(run_id=model.run_id, artifact_path=MANIFEST_NAME,
                                                           dst_path=work_dir, tracking_uri=tracking_uri)
            with open(path, encoding="utf-8") as f:
                return json.load(f), f"runs:/{model.run_id}/{MANIFEST_NAME}"
        except (MlflowException, OSError) as exc:
            log.warning("%s: no manifest.json in run %s: %s", model.uri, model.run_id, exc)
    raise ScoringError(f"{model.uri} has no training manifest (no readable '{SHARDS_TAG}' tag, no manifest.json "
                       f"in run {model.run_id or '(none)'}): nothing to check the input against")


def layout_digest(chunk_rows: int, part_rows: int) -> str:
    """What decides the output's row groups besides the input and the model."""
    canon = json.dumps({"chunk_rows": chunk_rows, "part_rows": part_rows, "format": OUTPUT_FORMAT, "writer": WRITER},
                       sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def output_prefix(root: str, model: ScoringModel, input_fingerprint: str, chunk_rows: int, part_rows: int) -> str:
    from common.paths import safe_component
    from common.storage import join

    key = f"{input_fingerprint[:16]}-{layout_digest(chunk_rows, part_rows)[:8]}"
    return join(root, SCORES_DIR, safe_component(model.name), f"v{model.version}", key)


def run_prefix(prefix: str, run_id: str) -> str:
    from common.paths import safe_component
    from common.storage import join

    return join(prefix, "runs", safe_component(run_id))


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def read_output_manifest(prefix: str) -> dict[str, Any] | None:
    """The committed output manifest at ``prefix`` (None: nothing committed yet)."""
    from common import storage

    try:
        return json.loads(storage.get_bytes(storage.join(prefix, MANIFEST_NAME)))
    except FileNotFoundError:
        return None


def predict_frame(model: Any, frame: pd.DataFrame, inputs: Sequence[tuple[str, str]], key: str,
                  first_row: int) -> pd.DataFrame:
    """One chunk's predictions: the key column (the id column's values, or ``ROW_COLUMN``: the
    rows' positions from ``first_row``), then the model's columns. Numeric inputs go in as
    float64 (what the model's signature was logged with; the model reads them as float32)."""
    import numpy as np
    import pandas as pd

    rows = frame[[name for name, _ in inputs]].copy()
    for name, kind in inputs:
        if kind == "numeric":
            rows[name] = rows[name].astype(np.float64)
    out = model.predict(rows).reset_index(drop=True)
    keys = frame[key].reset_index(drop=True) if key != ROW_COLUMN else \
        pd.Series(np.arange(first_row, first_row + len(frame), dtype=np.int64))
    out.insert(0, key, keys)
    return out


class PartWriter:
    """One part's predictions into a local Parquet file, chunk by chunk (one row group each)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = 0
        self._writer: Any = None
        self._schema: Any = None

    def write(self, frame: pd.DataFrame) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(frame, preserve_index=False)
        if self._writer is None:
            # pandas' metadata (index layout, its version) is no part of the predictions.
            self._schema = table.schema.remove_metadata()
            self._writer = pq.ParquetWriter(self.path, self._schema, **WRITER)
        table = table.replace_schema_metadata(None).cast(self._schema)
        self._writer.write_table(table, row_group_size=max(len(table), 1))
        self.rows += len(table)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    @property
    def empty(self) -> bool:
        return self._writer is None


def writer_settings() -> dict[str, Any]:
    """``WRITER`` and the library that applied it (``created_by`` in every file's footer)."""
    from importlib import metadata

    return {**WRITER, "pyarrow": metadata.version("pyarrow")}


def commit_output(prefix: str, manifest: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """Write the run's manifest as the prefix's committed one unless a run committed first:
    ``(committed, the committed manifest)``."""
    from common import storage

    data = json.dumps(manifest, sort_keys=True, indent=2).encode()
    try:
        storage.put_bytes(storage.join(prefix, MANIFEST_NAME), data, if_none_match=True)
        return True, dict(manifest)
    except storage.AlreadyExists:
        committed = read_output_manifest(prefix)
        assert committed is not None
        return False, committed


def same_bytes(ours: Sequence[Mapping[str, Any]], committed: Sequence[Mapping[str, Any]]) -> list[str]:
    """Parts whose sha256 differs between two runs' outputs (empty: byte-identical)."""
    theirs = {p["index"]: p["sha256"] for p in committed}
    return [part_name(p["index"]) for p in ours if theirs.get(p["index"]) != p["sha256"]] + \
        [part_name(i) for i in theirs if i not in {p["index"] for p in ours}]


def upload_part(local: str, uri: str) -> dict[str, Any]:
    from common import storage

    storage.upload_file(local, uri)
    return {"uri": uri, "bytes": os.path.getsize(local), "sha256": storage.sha256_file(local)}
