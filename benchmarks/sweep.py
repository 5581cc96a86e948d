#!/usr/bin/env python
"""A hyperparameter sweep on a generated table: the best trial against the default config, and
the compute the pruning saved.

The three-class table of ``testkit/scaled_tables.py`` (deterministic for ``--rows`` and
``--seed``) is sharded once with the config a DAG run resolves for it (``testkit.default_runs``);
then

- the default config trains (the same epoch budget, ``--epochs``, as every trial);
- a random sweep (``common.sweep.plan``: ``--trials`` draws over the learning rate, log-uniform,
  the dropout and the hidden layers) trains trial after trial, each with the ASHA pruning of the
  sweep DAG (``training.loop.pruning``: rungs at ``--min-epochs`` × ``--eta``^k; the trials meet
  at the rungs in a local folder, in the order they run);
- the best finished trial (by validation loss, ``plugins.sweep_tasks.best_of``) and the default
  are scored on the same raw test rows as the registered model serves them (test accuracy).

Every job is a real local job (2 ``dist_sync`` workers, 1 server) without Airflow, S3 or
MLflow: the sweep DAG runs the same jobs, two at once; here they run one after another, so the
rungs fill in trial order. The compute saved is the trial-epochs run against every trial run to
``--epochs`` (its share), beside the jobs' seconds and a lower bound of the seconds the pruned
trials' remaining epochs would have trained (their training steps' own rate); early stopping (the default's patience) stays
on in every job, so a trial may also end early without being pruned.

    .venv/bin/python benchmarks/sweep.py [--rows 4000] [--seed 0] [--trials 8] [--epochs 18]
        [--min-epochs 2] [--eta 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Before anything imports mxnet (it would block scikit-learn's import, see common/record_codec.py).
from sklearn.neural_network import MLPClassifier  # noqa: E402, F401

from common import storage  # noqa: E402
from testkit.default_runs import dag_defaults, exported_model, pipeline_score, split_rows  # noqa: E402
from testkit.local_jobs import make_job, run_local  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.scaled_tables import LABEL, scaled_classification_table  # noqa: E402

METRIC = "val_loss"


def space(trials: int, seed: int, min_epochs: int, eta: int) -> dict[str, Any]:
    """The sweep: the learning rate (log-uniform), the dropout and the hidden layers."""
    return {"method": "random", "trials": trials, "seed": seed, "metric": METRIC, "min_epochs": min_epochs,
            "reduction_factor": eta,
            "space": {"optim.learning_rate": {"low": 1e-4, "high": 3e-2, "log": True},
                      "model.dropout": [0.0, 0.1, 0.3], "model.hidden": [[64], [128, 64], [256, 128]]}}


def train(cfg: Any, shards: str, folder: str, pruning: dict[str, Any] | None = None) -> dict[str, Any]:
    """One real local job; its metrics and seconds."""
    job = make_job(cfg, shards, os.path.join(folder, "job"))
    if pruning:
        job = dataclasses.replace(job, pruning=pruning)
    started = time.monotonic()
    run_local(job, storage.join(folder, "job", "job.json"), os.path.join(folder, "home"))
    seconds = time.monotonic() - started
    return {"metrics": json.loads(storage.get_bytes(job.metrics_uri)), "seconds": seconds,
            "model_prefix": job.model_prefix}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4000, help="rows of the generated table")
    p.add_argument("--seed", type=int, default=0, help="the table's seed (and the sweep's draws')")
    p.add_argument("--trials", type=int, default=8, help="trials of the random sweep")
    p.add_argument("--epochs", type=int, default=18, help="the epoch budget of the default and of every trial")
    p.add_argument("--min-epochs", type=int, default=2, help="ASHA's first rung")
    p.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()

    from common.sweep import metric, plan, trial_value
    from data_checks.shard import shard_dataset
    from plugins.sweep_tasks import best_of, pruning_savings

    frame = scaled_classification_table(args.rows, args.seed)
    result: dict[str, Any] = {"rows": args.rows, "seed": args.seed, "epochs": args.epochs,
                              "sweep": space(args.trials, args.seed, args.min_epochs, args.eta)}
    with tempfile.TemporaryDirectory(prefix="mxpipe-sweep-bench-") as tmp:
        source = os.path.join(tmp, "table.csv")
        frame.to_csv(source, index=False)
        base = dag_defaults(source, LABEL, "classification", {"optim": {"epochs": args.epochs}})
        shards = os.path.join(tmp, "shards")
        manifest = shard_dataset(base, shards)
        ids = split_rows(manifest, shards, os.path.join(tmp, "splits"))

        default = train(base, shards, os.path.join(tmp, "default"))
        default_score = pipeline_score(exported_model(default["model_prefix"], os.path.join(tmp, "default")), frame,
                                       LABEL, "classification", ids)
        result["default"] = {"test_accuracy": default_score, "epochs_run": len(default["metrics"]["history"]),
                             "seconds": round(default["seconds"], 1)}
        print(f"default: test accuracy {default_score:.4f} after {result['default']['epochs_run']} epochs "
              f"({default['seconds']:.0f} s)", flush=True)

        swept = base.replace(sweep=result["sweep"])
        name, higher = metric(swept)
        outcomes, rows = [], []
        for trial in plan(swept):
            folder = os.path.join(tmp, f"trial-{trial.index}")
            pruning = {"rungs_prefix": os.path.join(tmp, "rungs"), "trial": trial.index, "min_epochs": args.min_epochs,
                       "eta": args.eta, "metric": name, "higher": higher}
            run = train(trial.config, shards, folder, pruning)
            m, best = run["metrics"], run["metrics"].get("best") or {}
            exported = best.get("best_epoch") if best.get("exported") == "best" else None
            outcome = "pruned" if m.get("pruned") else ("stopped early" if best.get("stopped_at_epoch") is not None
                                                        else "completed")
            steps_per_epoch = m["global_step"] / len(m["history"])
            epoch_s = steps_per_epoch * sum(r["step_time_s"] for r in m["history"]) / len(m["history"])
            o = {"index": trial.index, "label": trial.label, "outcome": outcome, "epochs": args.epochs,
                 "epochs_run": len(m["history"]), "value": trial_value(m["history"], name, exported),
                 "train_s_per_epoch": round(epoch_s, 2),
                 "seconds": round(run["seconds"], 1), "model_prefix": run["model_prefix"], "folder": folder}
            outcomes.append(o)
            rows.append({k: v for k, v in o.items() if k not in ("model_prefix", "folder")})
            print(f"{trial.label}: {outcome} after {o['epochs_run']} epochs, {name}={o['value']:.4f} "
                  f"({o['seconds']:.0f} s)", flush=True)
        best = best_of(outcomes, higher)
        assert best is not None, "no trial finished"
        best_score = pipeline_score(exported_model(best["model_prefix"], best["folder"]), frame, LABEL,
                                    "classification", ids)
    savings = pruning_savings(outcomes)
    pruned = [o for o in outcomes if o["outcome"] == "pruned"]
    result.update({
        "trials": rows,
        "best": {"trial": best["index"], "label": best["label"], name: best["value"], "test_accuracy": best_score},
        "best_minus_default_test_accuracy": best_score - default_score,
        "pruning": {"pruned_trials": len(pruned), **{k.removeprefix("sweep."): v for k, v in savings.items()},
                    # What the pruned trials' epochs left would have cost: at the seconds of training
                    # steps per epoch they ran at (evaluation and checkpoints not counted: a lower bound).
                    "job_seconds": round(sum(o["seconds"] for o in outcomes), 1),
                    "train_seconds_saved_lower_bound": round(sum(
                        o["train_s_per_epoch"] * (o["epochs"] - o["epochs_run"]) for o in pruned), 1)},
    })
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
