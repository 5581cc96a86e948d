"""Batch scoring throughput: the scoring DAG's chunked path beside the pyfunc model's own
``predict``, in one process, on the same rows and the same model.

    .venv/bin/python benchmarks/batch_score.py            # 1M rows in 8 Parquet files
    .venv/bin/python benchmarks/batch_score.py --quick    # 100k rows in 4 files

Steps (local files, no servers: the figures are the compute path, not S3's bandwidth):

1. a training table (blobs: 16 numeric columns and one categorical, 3 classes) is sharded with
   the debug recipe (``data_checks.shard``: the manifest's preprocessing record), a tiny Gluon MLP
   (``testkit.tiny_model``) is trained on its transformed features and saved as the registry
   saves it: the project's pyfunc model file with the preprocessing beside it, loaded back with
   ``mlflow.pyfunc.load_model`` (not timed);
2. the scoring table (same distribution, an ``id`` column) is written as Parquet files;
3. **checks**: the DAG's ``check`` pass (``profile`` + ``check_drift``: one read of the table and
   the Great Expectations run);
4. **DAG path**: ``plugins.score_tasks.score_rows`` over every part the DAG would map
   (``data_checks.score_input.parts``): read in chunks, predict, write Parquet (timed: all of it);
   the process's peak RSS is taken here;
5. **pyfunc predict**: the whole table read into one frame (not timed), then one
   ``model.predict(frame)``: the model's own throughput, memory permitting; peak RSS again.

Prints a table and a JSON line (``RESULT {...}``); ``--json FILE`` writes it too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit.result_file import write_json  # noqa: E402

NUM_FEATURES = 16
CLASSES = ["ant", "bee", "cow"]
TRAIN_ROWS = 3000


def table(rows: int, seed: int) -> Any:
    """Blobs with a categorical column and an id: the training table's distribution."""
    import numpy as np
    import pandas as pd

    from testkit.tiny_model import blobs

    X, yi = blobs(len(CLASSES), NUM_FEATURES, rows, sample_seed=seed)
    frame = pd.DataFrame(X.astype(np.float64), columns=[f"f{i}" for i in range(NUM_FEATURES)])
    frame["colour"] = np.asarray(["red", "green", "blue"])[np.random.RandomState(seed).randint(0, 3, rows)]
    frame["label"] = np.asarray(CLASSES)[yi]
    frame.insert(0, "id", [f"r{seed}-{i}" for i in range(rows)])
    return frame


def trained_model(work: str) -> tuple[Any, dict[str, Any]]:
    """The pyfunc model (as ``mlflow.pyfunc.load_model`` gives it) and its training manifest."""
    import mlflow.pyfunc
    import numpy as np
    from mlflow.models import infer_signature

    from common.config import overlay, recipe
    from data_checks.shard import shard_dataset
    from testkit.tiny_model import train_and_export
    from training.tracking import pyfunc_model

    train = table(TRAIN_ROWS, seed=7)
    source = os.path.join(work, "train.csv")
    train.to_csv(source, index=False)
    cfg = recipe("debug", source)
    cfg = type(cfg).from_dict(overlay(cfg.to_dict(), {"data": {"id_column": "id"}}))
    manifest = shard_dataset(cfg, os.path.join(work, "shards"))
    prep = manifest["preprocessing"]
    X = pyfunc_model.raw_features(prep, train)
    yi = np.asarray([manifest["classes"].index(c) for c in train["label"]])
    export = os.path.join(work, "export")
    train_and_export(export, X, yi, manifest["classes"], manifest["feature_columns"], preprocessing=prep)
    files = pyfunc_model.find_export_files(export)
    loaded = pyfunc_model.load_exported(files["symbol"], files["params"], files["meta"], files.get("preprocessing"))
    example = train.drop(columns=["id", "label"]).head(5)
    signature = infer_signature(example, pyfunc_model.predict_frame(loaded, loaded.features(example)))
    saved = os.path.join(work, "pyfunc")
    mlflow.pyfunc.save_model(saved, python_model=pyfunc_model.__file__, artifacts=dict(files), signature=signature,
                             input_example=example)
    return mlflow.pyfunc.load_model(saved), manifest


def _peak_rss_mb() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="100k rows in 4 files")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args()
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    n_files = args.files or (4 if args.quick else 8)

    import pandas as pd

    from data_checks.score_checks import model_inputs
    from data_checks.score_input import parts, plan_input
    from plugins import score_tasks

    with tempfile.TemporaryDirectory(prefix="bench-score-") as work:
        model, manifest = trained_model(work)
        folder = os.path.join(work, "input")
        os.makedirs(folder)
        per_file = rows // n_files
        for k in range(n_files):
            table(per_file, seed=100 + k).drop(columns=["label"]).to_parquet(
                os.path.join(folder, f"part-{k:03d}.parquet"), row_group_size=100_000, index=False)
        total = per_file * n_files
        inputs = model_inputs(manifest)
        target = {"inputs": [{"name": m.name, "kind": m.kind, "mean": m.mean, "std": m.std,
                              "categories": list(m.categories) if m.categories is not None else None,
                              "imputed": m.imputed} for m in inputs],
                  "key": "id", "chunk_rows": args.chunk_rows, "part_rows": score_tasks.DEFAULT_PART_ROWS,
                  "drift": {}, "input": plan_input(folder + "/").to_dict()}

        from data_checks.score_input import InputPlan

        # The chunked path first: the process's peak RSS then is what the DAG's tasks need (one
        # chunk at a time); the whole-table frame of the pyfunc figure comes after it.
        model.predict(table(1000, seed=1).drop(columns=["id", "label"]))  # warm-up: binds the network
        started = time.perf_counter()
        checked = score_tasks.check(target)
        check_s = time.perf_counter() - started
        plan = InputPlan.from_dict(target["input"])
        out = os.path.join(work, "out")
        os.makedirs(out)
        started = time.perf_counter()
        written = sum(score_tasks.score_rows(model, plan, part, target, os.path.join(out, f"{part['index']}.parquet"))
                      for part in checked["parts"])
        dag_s = time.perf_counter() - started
        assert written == total, (written, total)
        n_parts = len(parts(plan, score_tasks.DEFAULT_PART_ROWS))
        rss_chunked = _peak_rss_mb()

        whole = pd.concat([pd.read_parquet(os.path.join(folder, f)) for f in sorted(os.listdir(folder))],
                          ignore_index=True).drop(columns=["id"])
        started = time.perf_counter()
        predicted = model.predict(whole)
        predict_s = time.perf_counter() - started
        assert len(predicted) == total
        rss_whole = _peak_rss_mb()
        del whole, predicted

    result = {"rows": total, "files": n_files, "parts": n_parts, "chunk_rows": args.chunk_rows,
              "pyfunc_predict_rows_per_s": round(total / predict_s), "dag_path_rows_per_s": round(total / dag_s),
              "dag_path_over_predict": round(predict_s / dag_s, 3), "checks_rows_per_s": round(total / check_s),
              "seconds": {"predict": round(predict_s, 2), "dag_path": round(dag_s, 2), "checks": round(check_s, 2)},
              "peak_rss_mb": {"after_dag_path": rss_chunked, "after_whole_frame_predict": rss_whole}}
    print(f"{total} rows, {n_files} Parquet files, {n_parts} parts, chunks of {args.chunk_rows} rows")
    print(f"{'pyfunc predict (one frame in memory)':40s} {result['pyfunc_predict_rows_per_s']:>10} rows/s")
    print(f"{'DAG path (read, predict, write Parquet)':40s} {result['dag_path_rows_per_s']:>10} rows/s")
    print(f"{'DAG checks (profile + drift suite)':40s} {result['checks_rows_per_s']:>10} rows/s")
    print(f"peak RSS: {rss_chunked} MB after the DAG path (checks + scoring), {rss_whole} MB after the "
          "whole-frame predict")
    print("RESULT " + json.dumps(result))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
