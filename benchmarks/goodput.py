"""G1: goodput under a failure rate — ``kill -9`` of a random role every T seconds of a long run.

Runs the real DAG with ``dag.test()`` (``testkit/dag_stack.py``: Airflow's task runner and its
retry with ``MXPIPE_RETRY_DELAY_S``, the local cluster backend) against a SeaweedFS S3 server
and an MLflow server started here. ``dag.test()`` rather than the scheduler: the figure is the
training job's goodput, and a scheduler adds only its own polling delay to each retry (seconds,
on a machine whose two cores are shared), which would be measured as the scheduler's latency and
not the pipeline's recovery; the retry itself, its delay and the resume are Airflow's either way.

A killer thread (``testkit/killer.py``) kills one live role (scheduler, server or worker:
a seeded uniform choice among the newest attempt's live roles, found through the cluster's
records and checked by command line) every ``--period-s`` seconds from the first job start, at
most ``--max-kills`` times (default: until the run ends; the supervisor restarts the roles in
place after each, ``training.launch.restarts``, so no Airflow retry is spent on them; the
``--compare`` soaks average only the runs that took exactly ``--max-kills``, so give it there). The supervisor's event log (``MXPIPE_EVENTS_FILE``) gives the goodput and each
failure's timeline (``testkit/timeline.py``, whose docstring defines productive time: the wall
time of the steps that were kept, without startup, restore or recomputed steps).

The same config is first run once without failures (the reference): its final checkpoint's
parameter and optimizer files must be bit-identical to the soak's (``dist_sync``), and its own
goodput shows what startup alone costs.

The job: 2 workers, 1 server, ``dist_sync``, an MLP 32 → 1024 → 1024 → 512 → 10 (1.6 M parameters,
so a step moves about 6.4 MB each way per worker and takes tens of milliseconds here, not the
digits MLP's 2 ms) on a generated 10-class table (scikit-learn ``make_classification``, 60 000
rows × 32 features; 42 000 train rows, so 328 steps an epoch at batch 64 per worker), enough
epochs for at least 10 minutes of training on this machine.

``--compare 10,100,1000,auto`` then runs a (shorter: ``--compare-epochs``, ``--compare-period-s``)
soak per checkpoint interval, fixed or ``auto`` (Young/Daly from the measured checkpoint cost and
``checkpoint.mtbf_s``), with the same seed, and reports each goodput; ``--rounds R`` repeats that
R times, interleaved (each round in a rotated order, its own seed), and compares the means.

    nice -n 5 .venv/bin/python benchmarks/goodput.py [--period-s 300] [--epochs 50] [--every-n-steps 100]
    nice -n 5 .venv/bin/python benchmarks/goodput.py --skip-headline --compare 10,100,1000,auto [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit import REPO  # noqa: E402
from testkit.dag_stack import local_stack, read_events, run_dag, upload  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.killer import Killer  # noqa: E402
from testkit.timeline import cadence_plans, goodput  # noqa: E402

TABLE = ("import sys, numpy as np, pandas as pd; from sklearn.datasets import make_classification; "
         "from common import storage; rows, feats = int(sys.argv[2]), int(sys.argv[3]); "
         "X, y = make_classification(n_samples=rows, n_features=feats, n_informative=feats // 2, n_classes=10, "
         "n_clusters_per_class=1, random_state=0); "
         "f = pd.DataFrame(np.round(X, 5), columns=[f'x{i}' for i in range(feats)]); f['label'] = y; "
         "storage.put_bytes(sys.argv[1], f.to_csv(index=False).encode())")

FINAL = ("import sys, json; from common import storage; from common.paths import RunPaths; "
         "base = RunPaths(sys.argv[1], 'mxnet_training', sys.argv[2]).checkpoints; "
         "m = [u for u in storage.list_uris(base) if u.endswith('/MANIFEST.json')]; "
         "u = max(m); man = json.loads(storage.get_bytes(u)); "
         "print('FINAL ' + json.dumps({'step': man['step'], 'uri': u, "
         "'files': {n: f['sha256'] for n, f in man['files'].items() if n != 'state.json'}}))")

PHASES = ("detect", "teardown", "restart", "restore", "first_step", "total")


def cadence(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number of steps, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the checkpoint interval must be at least 1 step, got {n}")
    return n


def conf_for(args: argparse.Namespace, dataset: str, epochs: int, every: int | str,
             period_s: float) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"every_n_steps": every}
    if every == "auto":  # the failure rate the soak imposes is the MTBF Young/Daly is told
        checkpoint["mtbf_s"] = period_s
    # Early stopping off (on by default): the soak measures a fixed amount of training, the same
    # steps for the reference and the soak, and a run cut short would take none of its kills.
    return {"dataset_uri": dataset, "recipe": "digits", "epochs": epochs, "batch_size": args.batch_size,
            "learning_rate": 0.001, "num_workers": 2, "num_servers": 1, "kvstore": "dist_sync",
            "registered_model_name": "goodput-bench", "force": True,  # the reference and the soak both train
            "config": {"model": {"hidden": [int(h) for h in args.hidden.split(",")]}, "checkpoint": checkpoint,
                       "optim": {"early_stopping_patience": 0}}}


def final_checkpoint(env: dict[str, str], run_id: str) -> dict[str, Any]:
    """The newest committed checkpoint of a run: its step and the sha256 of each of its files."""
    out = subprocess.run([sys.executable, "-c", FINAL, env["MXPIPE_ARTIFACT_ROOT"], run_id], env=env,
                         capture_output=True, text=True, timeout=300, cwd=REPO, check=True)
    return json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("FINAL "))[6:])


def soak(env: dict[str, str], work: Path, name: str, conf: dict[str, Any], *, period_s: float,
         seed: int, max_kills: int) -> dict[str, Any]:
    """One DAG run (with the killer unless ``max_kills`` is 0): goodput, failures, final checkpoint."""
    run_dir = work / name
    run_dir.mkdir(parents=True)
    # One artifact root for every run (the DAG's Assets are named after it); each run has its own
    # partition in it, and its own MXPIPE_HOME, so the killer sees this run's cluster only.
    events, home = run_dir / "events.jsonl", run_dir / "home"
    run_env = {**env, "MXPIPE_EVENTS_FILE": str(events), "MXPIPE_HOME": str(home)}
    killer = Killer(str(home), events, period_s, seed, max_kills)
    if max_kills:
        killer.start()
    try:
        result = run_dag(run_env, conf, timeout_s=4 * 3600, log=run_dir / "dag.log")
    finally:
        if max_kills:
            killer.stop()
    if result["state"] != "success":
        raise RuntimeError(f"{name}: the run ended {result['state']}: {result['tasks']} (kills {killer.kills}); "
                           f"its log: {run_dir / 'dag.log'}")
    log = read_events(events)
    measured = goodput(log, [k["t"] for k in killer.kills])
    for failure, kill in zip(measured["failures"], killer.kills):
        failure["killed_role"] = kill["role"]
    measured.update(name=name, every_n_steps=conf["config"]["checkpoint"]["every_n_steps"],
                    train_tries=result["tasks"]["train"]["try_number"], events_file=str(events),
                    cadence_plans=cadence_plans(log),
                    final_checkpoint=final_checkpoint(run_env, result["run_id"]))
    print(summary_line(measured), flush=True)
    return measured


def summary_line(m: dict[str, Any]) -> str:
    fails = "; ".join(f"{f['killed_role']}: " + " ".join(f"{p} {f[p]:.1f}" for p in PHASES)
                      + f" s, {f['steps_recomputed']} steps again" for f in m["failures"])
    return (f"{m['name']}: goodput {m['goodput']:.4f} ({m['productive_s']:.0f} of {m['wall_s']:.0f} s, "
            f"{m['final_step']} steps at {m['seconds_per_step'] * 1000:.0f} ms, every {m['every_n_steps']} steps); "
            f"{fails or 'no failures'}")


def same_params(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Bit-identical final checkpoints (every file but the metrics-bearing state.json); None: other steps."""
    if a["step"] != b["step"]:
        return None
    return a["files"] == b["files"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--period-s", type=float, default=300.0, help="seconds between kills (T)")
    parser.add_argument("--seed", type=int, default=20, help="seed of the killer's choices")
    parser.add_argument("--max-kills", type=int, default=1000,
                        help="kills at most (default: one every period until the run ends); the --compare soaks "
                             "average the runs that took exactly this many")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--every-n-steps", type=cadence, default=100, help="checkpoint interval: N or auto")
    parser.add_argument("--rows", type=int, default=60000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", default="1024,1024,512")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--retry-delay-s", type=float, default=1.0)
    parser.add_argument("--skip-headline", action="store_true", help="only the --compare soaks")
    parser.add_argument("--compare", default="", help="checkpoint intervals to compare, e.g. 10,100,1000,auto")
    parser.add_argument("--compare-epochs", type=int, default=10)
    parser.add_argument("--compare-period-s", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the --compare soaks")
    parser.add_argument("--keep", help="a folder for the runs' event logs and DAG logs (default: a temp folder)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--summarise", metavar="FILE", help="recompute the comparison's statistics in a --json "
                        "file written earlier (its runs are kept; nothing is run)")
    args = parser.parse_args()
    if args.summarise:
        with open(args.summarise) as fh:
            report = json.load(fh)
        c = report["comparison"]
        kept = {k: c[k] for k in ("epochs", "period_s", "rounds", "rows") if k in c}
        report["comparison"] = kept | {"max_kills": c.get("max_kills", args.max_kills)} | summarise(
            c["rows"], c.get("max_kills", args.max_kills))
        with open(args.summarise, "w") as fh:  # its recorded command stays the one that measured it
            json.dump(report, fh, indent=2)
        return 0
    compare = [cadence(v.strip()) for v in args.compare.split(",") if v.strip()]
    if args.skip_headline and not compare:
        parser.error("--skip-headline needs --compare")

    report: dict[str, Any] = {"period_s": args.period_s, "seed": args.seed, "epochs": args.epochs,
                              "rows": args.rows, "hidden": args.hidden, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory(prefix="mxpipe-g1-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        with local_stack(root, artifact_prefix="goodput", retry_delay_s=args.retry_delay_s) as (env, bucket):
            dataset = f"s3://{bucket}/datasets/table.csv"
            upload(env, dataset, TABLE, str(args.rows), str(args.features))
            if not args.skip_headline:
                conf = conf_for(args, dataset, args.epochs, args.every_n_steps, args.period_s)
                ref = soak(env, root, "reference", conf, period_s=args.period_s, seed=args.seed, max_kills=0)
                run = soak(env, root, "soak", conf, period_s=args.period_s, seed=args.seed,
                           max_kills=args.max_kills)
                run["params_identical"] = same_params(run["final_checkpoint"], ref["final_checkpoint"])
                print(f"parameters bit-identical to the uninterrupted run: {run['params_identical']}", flush=True)
                report.update(reference=ref, headline=run)
            rows = []
            for rnd, every in comparison_order(compare, args.rounds):
                conf = conf_for(args, dataset, args.compare_epochs, every, args.compare_period_s)
                row = soak(env, root, f"compare-{every}-r{rnd}", conf, period_s=args.compare_period_s,
                           seed=args.seed + rnd, max_kills=args.max_kills)
                rows.append(row | {"round": rnd})
            if rows:
                report["comparison"] = comparison(rows, args)
    write_json(args.json, report)
    return 0 if report.get("headline", {}).get("params_identical", True) else 1


def comparison_order(compare: list[int | str], rounds: int) -> list[tuple[int, int | str]]:
    """The ``--compare`` soaks as (round, interval), in the order they run.

    Interleaved, each round in a rotated order: a drift in the machine's load falls on every
    interval alike rather than on whichever ran last. One seed per round: the same kill times and
    roles for every interval of that round. No intervals (no ``--compare``): nothing to run."""
    return [(rnd, every) for rnd in range(rounds) if compare
            for every in compare[rnd % len(compare):] + compare[:rnd % len(compare)]]


def comparison(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The comparison's runs, reduced to what is reported, and their statistics (``summarise``)."""
    reduced = [{k: r[k] for k in ("round", "every_n_steps", "goodput", "wall_s", "productive_s", "seconds_per_step")}
               | {"lost_s": [round(f["lost_s"], 2) for f in r["failures"]],
                  "recovery_s": [round(f["total"], 2) for f in r["failures"]],
                  "steps_recomputed": [f["steps_recomputed"] for f in r["failures"]],
                  "cadence_plans": r["cadence_plans"]}
               for r in rows]
    out = {"epochs": args.compare_epochs, "period_s": args.compare_period_s, "rounds": args.rounds,
           "max_kills": args.max_kills, "rows": reduced}
    return out | summarise(reduced, args.max_kills)


def summarise(rows: list[dict[str, Any]], max_kills: int) -> dict[str, Any]:
    """Per interval, over the runs that took every kill: mean wall time and mean goodput; the
    best fixed interval by each; auto's difference from it, as means and per round (paired: the
    same kill times, the same stretch of the machine's load).

    Every run trains the same steps and is killed at the same times, so the wall time to finish
    is the whole cost of a cadence: recomputed steps, and also the slowdown of the steps while
    uploads run, which goodput counts as productive time (a kept step is productive however
    long it took). Goodput is reported beside it as defined for the headline."""
    # A run that ended before a kill was due (a faster stretch of the machine) took fewer
    # failures and lost less for that reason alone: it is listed, not averaged.
    full = [r for r in rows if len(r["lost_s"]) == max_kills]
    by: dict[Any, list[dict[str, Any]]] = {}
    for r in full:
        by.setdefault(r["every_n_steps"], []).append(r)
    out: dict[str, Any] = {"runs_averaged": {str(k): len(v) for k, v in by.items()},
                           "left_out": [f"every {r['every_n_steps']}, round {r['round']}: {len(r['lost_s'])} of "
                                        f"{max_kills} kills landed" for r in rows if r not in full]}
    for measure, better in (("wall_s", min), ("goodput", max)):
        means = {every: statistics.mean(r[measure] for r in runs) for every, runs in by.items()}
        out[f"mean_{measure}"] = {str(k): v for k, v in means.items()}
        fixed = [every for every in by if every != "auto"]
        if not fixed:
            continue
        best = better(fixed, key=lambda every: means[every])
        out[f"best_fixed_by_{measure}"] = {"every_n_steps": best, f"mean_{measure}": means[best]}
        if "auto" in by:
            paired = {r["round"]: r[measure] for r in by[best]}
            out[f"auto_minus_best_fixed_{measure}"] = means["auto"] - means[best]
            out[f"auto_minus_best_fixed_{measure}_per_round"] = [r[measure] - paired[r["round"]] for r in by["auto"]
                                                                 if r["round"] in paired]
        print(f"comparison (mean {measure}): " + ", ".join(f"every {k}: {v:.4g}" for k, v in means.items()),
              flush=True)
    out["median_lost_s_per_failure"] = statistics.median([x for r in rows for x in r["lost_s"]] or [0.0])
    return out


if __name__ == "__main__":
    sys.exit(main())
