"""What each task of the batch-scoring DAG (``dags/mxnet_batch_score.py``) does.

resolve → needs_scoring → check → score_part (mapped: one per part of the input) → finish.

- ``resolve``: the input (the triggering asset event's ``extra["input_uri"]``, else the
  ``input_uri`` Param), the model version (``training.tracking.batch_score.resolve_model``) and its
  training manifest, the input's files and fingerprint (``data_checks.score_input``), the schema
  check (``data_checks.score_checks.check_schema``) and the output prefix. A bad input, model or
  schema fails here, without a retry.
- ``needs_scoring``: False (everything after it skipped) when the prefix already holds a
  committed output of this input and version and ``rescore`` is off: the rerun finds it.
- ``check``: one streaming pass over the input: the drift check against the train statistics
  (Great Expectations; a failure names the columns), the row count of each part (the row
  positions of a table without an id column) and the parts to map over (its return value; the
  checks' outcome is a keyed XCom for ``finish``).
- ``score_part``: one part read in chunks, scored with ``models:/<name>/<version>`` (pyfunc) and
  written as one Parquet file under the run's own prefix.
- ``finish``: the output manifest (model version, model run id, input fingerprint, parts with
  sha256, checks), written beside the parts and committed at the prefix if no run did first; a
  rerun's parts are compared with the committed ones, and a difference fails the run.

Light at import (the DAG file imports it at parse time): the Param defaults only; pandas,
pyarrow, mlflow and Great Expectations are imported inside the functions.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from common.settings import settings
from data_checks.score_checks import DEFAULT_DRIFT, DRIFT_SCHEMA  # noqa: F401  (the DAG's Param)
from plugins.assets import SCORE_INPUT
from plugins.failures import fail_without_retry

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 50_000
DEFAULT_PART_ROWS = 1_000_000
# The key of a ``plugins.assets.SCORE_INPUT`` event's extra that names the input.
INPUT_KEY = "input_uri"


@contextmanager
def _deterministic() -> Iterator[None]:
    """Bad input, a bad model reference or a failed check fails the task without a retry."""
    from common.errors import DeterministicError

    try:
        yield
    except DeterministicError as exc:
        raise fail_without_retry(f"batch scoring: {exc}") from exc


def from_events(events: Mapping[Any, Iterable[Any]] | None) -> dict[str, Any]:
    """The newest triggering event's extra that names an input (empty: none did)."""
    latest: tuple[Any, dict[str, Any]] | None = None
    for asset_events in (events or {}).values():
        for event in asset_events:
            extra = dict(getattr(event, "extra", None) or {})
            if not extra.get(INPUT_KEY):
                continue
            stamp = getattr(event, "timestamp", None)
            if latest is None or (stamp is not None and latest[0] is not None and stamp > latest[0]):
                latest = (stamp, extra)
    return latest[1] if latest else {}


def part_label(part: Mapping[str, Any]) -> str:
    """A mapped task's name: its file, and its row groups when the file is cut into parts."""
    groups = part.get("row_groups")
    return part["uri"].rsplit("/", 1)[-1] + (f" [row groups {groups[0]}..{groups[1] - 1}]" if groups else "")


def _tracking_uri() -> str:
    uri = settings().mlflow_tracking_uri
    if not uri:
        raise fail_without_retry("no mlflow_default connection and MLFLOW_TRACKING_URI is not set: "
                                 "nowhere to find the model")
    return uri


def resolve(params: Mapping[str, Any], events: Mapping[Any, Iterable[Any]] | None, dag_id: str,
            run_id: str) -> dict[str, Any]:
    """The run's target: model, input plan, columns, output prefixes, and any committed output."""
    from dataclasses import asdict

    from common.manifest import manifest_digest
    from data_checks.score_checks import check_schema, model_inputs
    from data_checks.score_input import plan_input
    from training.tracking import batch_score as bs

    event = from_events(events)
    spec = event.get(INPUT_KEY) or params.get("input_uri") or ""
    if not spec:
        raise fail_without_retry(f"batch scoring: no input: set the input_uri Param or post an event on "
                                 f"{SCORE_INPUT.uri} with extra {{'{INPUT_KEY}': ...}}")
    name = event.get("model_name") or params["model_name"]
    version = str(event.get("version") or params.get("version") or "") or None
    chunk_rows, part_rows = int(params["chunk_rows"]), int(params["part_rows"])
    tracking = _tracking_uri()
    with _deterministic(), tempfile.TemporaryDirectory(prefix="mxpipe-score-") as tmp:
        model = bs.resolve_model(tracking, name, version)
        manifest, manifest_at = bs.training_manifest(model, tracking, tmp)
        inputs = model_inputs(manifest)
        plan = plan_input(spec)
        id_column = manifest.get("id_column") or None
        check_schema(inputs, plan, id_column)
    prefix = bs.output_prefix(settings().artifact_root, model, plan.fingerprint, chunk_rows, part_rows)
    committed = bs.read_output_manifest(prefix)
    log.info("scoring %s (%d files, fingerprint %s) with %s (%s); output under %s%s", spec, len(plan.files),
             plan.fingerprint[:16], model.uri, model.requested, prefix,
             f"; already scored by run {committed['run']['run_id']}" if committed else "")
    return {"model": model.to_dict(), "input": plan.to_dict(), "inputs": [asdict(m) for m in inputs],
            "key": id_column or bs.ROW_COLUMN, "id_column": id_column, "prefix": prefix,
            "run_prefix": bs.run_prefix(prefix, run_id), "chunk_rows": chunk_rows, "part_rows": part_rows,
            "training_manifest": {"uri": manifest_at, "digest": manifest_digest(manifest)},
            "drift": dict(params.get("drift") or {}), "rescore": bool(params.get("rescore")),
            "committed": committed}


def needs_scoring(target: Mapping[str, Any]) -> bool:
    committed = target["committed"]
    if committed and not target["rescore"]:
        log.info("%s already holds the output of this input and model version (run %s, %d rows): nothing to "
                 "score; trigger with rescore=true to score again and compare", target["prefix"],
                 committed["run"]["run_id"], committed["rows"])
        return False
    return True


def _model_inputs(target: Mapping[str, Any]) -> list[Any]:
    from data_checks.score_checks import ModelInput

    return [ModelInput(**{**m, "categories": tuple(m["categories"]) if m["categories"] is not None else None})
            for m in target["inputs"]]


def check(target: Mapping[str, Any]) -> dict[str, Any]:
    """The drift check over the whole input, and the parts to map over (with their first row).

    This pass reads the whole input, and ``score_part`` reads it again: a mismatch must fail
    before any part is scored, and drift in a part a sample skipped would go unseen. The pass
    keeps only a one-row-per-column profile and the row counts, so the second read costs I/O,
    not memory."""
    from data_checks.score_checks import check_drift, profile
    from data_checks.score_input import InputPlan, parts, read_rows

    plan = InputPlan.from_dict(target["input"])
    inputs = _model_inputs(target)
    names = [m.name for m in inputs]
    text = [m.name for m in inputs if m.kind == "categorical"]
    todo = parts(plan, target["part_rows"])
    counted = []

    def frames() -> Iterator[Any]:
        row = 0
        for part in todo:
            rows = 0
            for frame in read_rows(plan, part, names, text, target["chunk_rows"]):
                rows += len(frame)
                yield frame
            counted.append({**part, "first_row": row, "rows": rows})
            row += rows

    with _deterministic():
        prof = profile(inputs, frames())
        drift = check_drift(inputs, prof, target["drift"], plan.spec)
    log.info("input checked: %d rows in %d parts, no drift beyond %s", prof.rows, len(counted), drift["thresholds"])
    return {"parts": counted, "checks": {**drift, "rows": prof.rows}}


def score_rows(model: Any, plan: Any, part: Mapping[str, Any], target: Mapping[str, Any], path: str) -> int:
    """The chunked scoring path: ``part`` of ``plan`` read in chunks, each scored by the pyfunc
    ``model`` and written as a row group of the Parquet file ``path``; returns the rows written."""
    from data_checks.score_input import read_rows
    from training.tracking.batch_score import ROW_COLUMN, PartWriter, predict_frame

    inputs = [(m["name"], m["kind"]) for m in target["inputs"]]
    key = target["key"]
    columns = [name for name, _ in inputs] + ([key] if key != ROW_COLUMN and key not in dict(inputs) else [])
    text = [name for name, kind in inputs if kind == "categorical"]
    writer = PartWriter(path)
    row = int(part["first_row"])
    try:
        for frame in read_rows(plan, part, columns, text, int(target["chunk_rows"])):
            writer.write(predict_frame(model, frame, inputs, key, row))
            row += len(frame)
    finally:
        writer.close()
    return writer.rows


def score_part(target: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    import mlflow.pyfunc

    from data_checks.score_input import InputPlan
    from training.tracking import batch_score as bs
    from training.tracking.runs import bounded_mlflow_env, fluent_tracking_uri

    with fluent_tracking_uri(_tracking_uri()), bounded_mlflow_env():
        model = mlflow.pyfunc.load_model(target["model"]["uri"])
    plan = InputPlan.from_dict(target["input"])
    name = bs.part_name(int(part["index"]))
    with _deterministic(), tempfile.TemporaryDirectory(prefix="mxpipe-score-part-") as tmp:
        path = os.path.join(tmp, name)
        rows = score_rows(model, plan, part, target, path)
        stored = bs.upload_part(path, f"{target['run_prefix']}/{name}") if rows else \
            {"uri": None, "bytes": 0, "sha256": None}  # a file with a header and no rows: no output file
    log.info("part %d (%s, row groups %s): %d rows scored into %s", part["index"], part["uri"], part["row_groups"],
             rows, stored["uri"])
    return {"index": int(part["index"]), "source": part["uri"], "first_row": int(part["first_row"]),
            "rows": rows, **stored}


def finish(target: Mapping[str, Any], checks: Mapping[str, Any], results: Iterable[Mapping[str, Any]],
           dag_id: str, run_id: str) -> dict[str, Any]:
    """Write the run's output manifest and commit it at the prefix (first run wins); a rerun whose
    bytes differ from the committed output fails."""
    import json

    from common import storage
    from training.tracking import batch_score as bs

    parts = sorted((dict(r) for r in results), key=lambda r: r["index"])
    rows = int(checks["rows"])
    if sum(p["rows"] for p in parts) != rows:
        raise RuntimeError(f"the parts hold {sum(p['rows'] for p in parts)} rows, the input {rows}")
    manifest = {"format_version": bs.OUTPUT_FORMAT, "model": target["model"],
                "input": {"spec": target["input"]["spec"], "fingerprint": target["input"]["fingerprint"],
                          "files": [f["identity"] for f in target["input"]["files"]]},
                "training_manifest": target["training_manifest"], "key_column": target["key"], "rows": rows,
                "layout": {"chunk_rows": target["chunk_rows"], "part_rows": target["part_rows"]},
                "writer": bs.writer_settings(), "parts": parts,
                "checks": {"schema": "passed", **{k: v for k, v in checks.items() if k != "rows"}},
                "run": {"dag_id": dag_id, "run_id": run_id, "prefix": target["run_prefix"]}}
    storage.put_bytes(f"{target['run_prefix']}/{bs.MANIFEST_NAME}", json.dumps(manifest, sort_keys=True,
                                                                               indent=2).encode())
    committed, output = bs.commit_output(target["prefix"], manifest)
    if not committed:
        differ = bs.same_bytes(parts, output["parts"])
        if differ:
            raise fail_without_retry(f"batch scoring: run {run_id} scored {target['input']['spec']} with "
                                     f"{target['model']['uri']} into other bytes than run {output['run']['run_id']} "
                                     f"did (parts {differ}): scoring is not reproducible")
        log.info("rescored: byte-identical to the committed output of run %s", output["run"]["run_id"])
    log.info("%d rows scored with %s into %s", rows, target["model"]["uri"], target["run_prefix"])
    return {"prefix": target["prefix"], "output": output["run"]["prefix"], "committed": committed,
            "identical_to": None if committed else output["run"]["run_id"], "rows": rows,
            "model_version": target["model"]["version"], "parts": len(parts)}
