"""One benchmark report: runs P1–P8 (with D1, C1, Q1–Q6, N1, C2, G1, G2, S1, O1–O3 and chaos R4) side by
side on this machine and writes the table into benchmarks/README.md (between the report markers)
and benchmarks/results.json, with the planner's predictions beside the measurements (``benchmarks/predicted.py``).

    benchmarks/run                 # quick mode (about 25 minutes on 2 cores)
    benchmarks/run --full          # the long settings of every benchmark
    benchmarks/run --only P2,P7    # a subset (the other rows of the table are left out)
    benchmarks/run --only N1,C2 --merge                   # a subset; the other rows kept from results.json
    benchmarks/run --record G1=g1.json --merge            # a figure measured by hand (`goodput.py --json g1.json`)
    benchmarks/run --rerender                             # the last report again, predictions recomputed

Each benchmark is its own script (run on its own here, one after another, so that they do not
compete for the cores), writes its figures as JSON, and is summarised in one row: the measure,
its goal, the figure, the ratio where the goal is one, whether the goal is met, the date and the
command that reproduces it. A benchmark that fails gets a row that says so; the others still run.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

# The checkout on the path (run as ``python benchmarks/run.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit import REPO  # noqa: E402
from benchmarks import predicted  # noqa: E402

README = os.path.join(REPO, "benchmarks", "README.md")
RESULTS = os.path.join(REPO, "benchmarks", "results.json")
BEGIN, END = "<!-- benchmarks/run: begin -->", "<!-- benchmarks/run: end -->"

Row = tuple[str, float | None, bool | None]  # figure, ratio, goal met


@dataclass(frozen=True)
class Bench:
    id: str
    measure: str
    goal: str
    script: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    timeout_s: int
    summarise: Callable[[dict[str, Any]], Row]

    def command(self, full: bool) -> list[str]:
        return [os.path.join("benchmarks", self.script), *(self.full if full else self.quick)]


def _p1(r: dict[str, Any]) -> Row:
    ratio = r["ratio"]
    rounds = ", ".join(f"{x:.2f}" for x in r.get("round_ratios", []))
    return (f"{r['pipeline_samples_per_s']:.0f} vs {r['bare_samples_per_s']:.0f} samples/s (best of each; "
            f"round by round {rounds})", ratio, ratio >= 0.98)


def _p2(r: dict[str, Any]) -> Row:
    frac, per_save = r["async_blocked_fraction"], r["async_blocked_steps_per_save"]
    return (f"blocked {frac:.2%} of loop time (sync {r['sync_blocked_fraction']:.0%}), {per_save:.2f} steps per "
            f"save, {r['checkpoint_mb']:.0f} MB every {r['checkpoint_every']} steps", frac,
            frac <= 0.01 and per_save <= 1)


def _p3(r: dict[str, Any]) -> Row:
    ratio = r["p3_ratio"]
    return (f"{r['checkpoint_save_MBps']:.0f} vs {r['raw_put_MBps']:.0f} MB/s; restore "
            f"{r['restore_read_verify_s'] + r['restore_load_s']:.2f} s", ratio, ratio >= 0.9)


def _p4(r: dict[str, Any]) -> Row:
    total, detect = r["total_median_s"], r["detect_median_s"]
    return (f"{total:.1f} s median (max {r['total_max_s']:.1f}), detect {detect:.2f} s, {r['runs']} runs, "
            f"{r.get('recovery', 'Airflow retry')}", None, total <= 10 and detect <= 5)


def _s1(r: dict[str, Any]) -> Row:
    return (f"{r['steps_lost_max']} steps lost (max of {len(r['runs'])} notices) where a crash at the same moments "
            f"loses {r['crash_steps_lost_mean']:.1f} (mean; a checkpoint every {r['every_n_steps']} steps); notice → "
            f"first step after the resume {r['seconds_to_first_step_median']:.1f} s (median)", None,
            r["steps_lost_max"] == 0)


def _p5(r: dict[str, Any]) -> Row:
    # Same run as P1 (one script, cached): its "ratio" is P1's; P5's is computed from its figures.
    ratio = r["dist_samples_per_s"] / r["single_samples_per_s"]
    return (f"{r['dist_samples_per_s']:.0f} vs {r['single_samples_per_s']:.0f} samples/s", ratio, ratio >= 0.95)


def _d1(r: dict[str, Any]) -> Row:
    # Same run as P1: the bare loop with denormals flushed (as every role runs) ÷ with IEEE ones.
    return (f"{r['bare_samples_per_s']:.0f} vs {r['bare_ieee_samples_per_s']:.0f} samples/s", r["flush_gain"], None)


def _p6(r: dict[str, Any]) -> Row:
    ratio = r["ratio_to_raw_copy"]
    return (f"{r['shard_mb_per_s']:.1f} vs {r['raw_copy_mb_per_s']:.1f} MB/s ({r['source_mb']:.0f} MB CSV); "
            f"validate {r['validate_rows_per_s']} rows/s", ratio, ratio >= 0.5)


def _p7(r: dict[str, Any]) -> Row:
    worst = r["worst_median_s"]
    files = ", ".join(f"{name} {f['median_s']:.2f} s" for name, f in r["files"].items())
    heavy = ", ".join(r["heavy"]) or "none"
    return (f"{files}; heavy modules: {heavy}", None, worst <= 0.5 and not r["heavy"])


def _p8(r: dict[str, Any]) -> Row:
    ratio = r["ratio_to_fastest"]
    return (f"{r['chosen']} ÷ fastest ({r['fastest']})", ratio, None)


def _compression(r: dict[str, Any]) -> Row:
    ratio = r["bytes_ratio"]
    return (f"{r['compressed_bytes_per_step']:.0f} vs {r['plain_bytes_per_step']:.0f} bytes pushed per step; "
            f"throughput ×{r['throughput_ratio']:.2f}", ratio, None)


def _reference_row(row: dict[str, Any]) -> str:
    return (f"{row['metric']} {row['pipeline']:.3f} vs {row['reference']:.3f} ({row['reference_name']}; "
            f"{row['train_rows']} train / {row['test_rows']} test rows, {row['epochs_run']} epochs)")


def _q1(r: dict[str, Any]) -> Row:
    return (_reference_row(r["wine"]), r["wine"]["ratio"], r["met"]["Q1"])


def _q2(r: dict[str, Any]) -> Row:
    return (_reference_row(r["diabetes"]), r["diabetes"]["ratio"], r["met"]["Q2"])


def _q3(r: dict[str, Any]) -> Row:
    row, served = r["cities"], r["cities"]["unseen_rows"]
    return (f"test accuracy {row['pipeline']:.3f} on {row['test_rows']} raw test rows ({row['test_rows_with_missing']} "
            f"with a missing value); {served['rows']} raw rows with an unseen city and missing values predicted "
            f"{served['labels']}", None, r["met"]["Q3"])


def _q4(r: dict[str, Any]) -> Row:
    return (_reference_row(r["regression"]), r["regression"]["ratio"], r["met"]["regression"])


def _q5(r: dict[str, Any]) -> Row:
    figure, ratio = _reference_row(r["classification"]), r["classification"]["ratio"]
    if "mean_ratio" in r:  # one test split is a few hundred rows: the mean over several tables too
        n = 1 + len(r["more_seeds"])
        figure += f"; mean ratio over {n} generated tables {r['mean_ratio']['classification']:.3f}"
        return figure, ratio, r["mean_ratio"]["classification"] >= 1.0
    return figure, ratio, r["met"]["classification"]


def _q6(r: dict[str, Any]) -> Row:
    now, before = r["digits"], r["digits_before"]
    return (f"{now['train_s']:.1f} s ({now['epochs_run']} epochs, test accuracy {now['pipeline']:.3f}) vs "
            f"{before['train_s']:.1f} s ({before['epochs_run']} epochs, {before['pipeline']:.3f})",
            r["digits_time_ratio"], r["met"]["digits_within_2x"])


def _n1(r: dict[str, Any]) -> Row:
    if "skipped" in r:
        return (f"skipped: {r['skipped']}", None, None)
    points = "; ".join(f"{p['rate_mbit']:g} Mbit/s {p['step_time_s'] * 1000:.0f} ms (comm {p['measured_comm_s'] * 1000:.0f} "
                       f"vs planned {p['predicted_comm_s'] * 1000:.0f})" for p in r["sweep"])
    ratios = [p["measured_over_predicted"] for p in r["sweep"]]
    return (f"unconstrained {r['unconstrained']['step_time_s'] * 1000:.0f} ms/step; {points}",
            sum(ratios) / len(ratios), None)


def _c2(r: dict[str, Any]) -> Row:
    if "skipped" in r:
        return (f"skipped: {r['skipped']}", None, None)
    c = r["compression"]
    return (f"at {c['rate_mbit']:g} Mbit/s: wall ×{c['wall_ratio']:.2f}, step ×{c['step_time_ratio']:.2f}; val accuracy "
            f"{c['compressed']['val_accuracy']:.4f} vs {c['plain']['val_accuracy']:.4f} "
            f"({c['accuracy_cost_points']:+.2f} points lost)", c["wall_ratio"], None)


def _g2(r: dict[str, Any]) -> Row:
    h = r["headline"]
    totals = sorted(f["total"] for f in h["failures"])
    median = totals[len(totals) // 2] if totals else float("nan")
    identical = h["params_identical"] is True
    figure = (f"{len(totals)} kills, one every {r['period_s']:g} s; train task tries {h['train_tries']}, "
              f"{h['attempts']} rounds of roles; kill → first step {median:.1f} s median (max "
              f"{max(totals, default=float('nan')):.1f}); goodput {h['goodput']:.3f}; parameters bit-identical: "
              f"{h['params_identical']}")
    return figure, None, len(totals) >= 20 and h["train_tries"] == 1 and identical


def _g1(r: dict[str, Any]) -> Row:
    h = r["headline"]
    fails = ", ".join(f"{f['killed_role']} {f['lost_s']:.1f} s lost ({f['total']:.1f} s to the first step, "
                      f"{f['steps_recomputed']} steps again)" for f in h["failures"])
    figure = (f"goodput {h['goodput']:.3f} over {h['wall_s'] / 60:.1f} min, a kill every {r['period_s']:g} s: "
              f"{fails or 'no kill landed'}; parameters bit-identical: {h['params_identical']}")
    if "comparison" in r:
        c = r["comparison"]
        figure += f"; cadence (mean of {c['rounds']} round(s): wall s / goodput) " + ", ".join(
            f"{every}: {c['mean_wall_s'][every]:.0f} / {g:.3f}" for every, g in c["mean_goodput"].items())
    identical = h["params_identical"] is True
    # The goal is stated at one failure every 300 s; a shorter period (quick mode) only checks the parameters.
    return (figure, h["goodput"], (h["goodput"] >= 0.97 and identical) if r["period_s"] >= 300 else identical)


def _o1(r: dict[str, Any]) -> Row:
    d, s = r["deferrable"]["slots"], r["synchronous"]["slots"]
    return (f"deferrable {d['running_tis_max']} (busy executor workers max {d['busy_workers_max']}); synchronous, as "
            f"the former @task: {s['running_tis_max']} (busy workers max {s['busy_workers_max']}); "
            f"{d['samples']}+{s['samples']} samples", None, d["running_tis_max"] == 0 and d["busy_workers_max"] == 0)


def _o2(r: dict[str, Any]) -> Row:
    d, s = r["deferrable"]["restart"], r["synchronous"]["restart"]
    return (f"scheduler+triggerer kill -9 (deferred): {d['steps_recomputed']} steps recomputed, {d['jobs_started']} "
            f"job, try {d['train_try_number']}; task process kill -9 (synchronous): {s['steps_recomputed']} steps, "
            f"{s['jobs_started']} job, reconnected on try {s['train_try_number']}", None,
            d["steps_recomputed"] == s["steps_recomputed"] == 0 and d["jobs_started"] == s["jobs_started"] == 1)


def _o3(r: dict[str, Any]) -> Row:
    m = r["deferrable"]["mark_failed"]
    return (f"{m['stop_s']:.1f} s to no process left; emergency checkpoint at step {m['emergency_checkpoint_step']} "
            f"(step {m['step_at_request']} when asked); train tries {m['train_try_number']}", None,
            m["emergency_checkpoint_step"] >= m["step_at_request"] and m["train_try_number"] == 1)


def _r4(r: dict[str, Any]) -> Row:
    trials = [t for t in r["trials"] if t["scenario"] == "R4"]
    if not trials:
        return ("skipped: needs root and `ip netns`", None, None)
    figure = "; ".join(f"{t['name'].split('down ')[1].split(' (')[0]} cut: {t['details']['outcome']}"
                       + (f" ({t['recovery_s']:.1f} s to recover)" if t["recovery_s"] is not None else "")
                       for t in trials)
    return (figure, None, all(t["passed"] for t in trials))


BENCHES = (
    Bench("P1", "trainer throughput ÷ bare Gluon loop (same model, data, kvstore, cluster)", "≥ 0.98",
          "trainer_throughput.py", ("--quick",), (), 1200, _p1),
    Bench("P2", "training time blocked by async checkpointing (ResNet-18, params + states)",
          "≤ 1 %, ≤ 1 step per save", "checkpoint_overhead.py", (), ("--full",), 1800, _p2),
    Bench("P3", "checkpoint upload ÷ raw boto3 put of the same bytes", "≥ 0.9",
          "checkpoint_overhead.py", (), ("--full",), 1800, _p3),
    Bench("P4", "kill -9 of a worker → first step after the resume, through Airflow (restart in place)",
          "≤ 10 s, detect ≤ 5 s", "recovery.py", ("--runs", "1"), ("--runs", "3"), 1800, _p4),
    Bench("S1", "spot interruption notice mid-training → steps lost (emergency checkpoint, restart in place), "
          "against a crash at the same moment", "0 steps lost", "spot_notice.py", (), (), 1200, _s1),
    Bench("O1", "worker slots held by the train task while its job trains (real scheduler, LocalExecutor)",
          "0 (was 1 per run)", "operator_durability.py", (), ("--sample-s", "40"), 3600, _o1),
    Bench("O2", "steps recomputed after an Airflow restart mid-training (per-step job logs)",
          "0, one job (was: since the last checkpoint + a second job)", "operator_durability.py", (),
          ("--sample-s", "40"), 3600, _o2),
    Bench("O3", "mark the run failed mid-training → every role stopped, emergency checkpoint first",
          "reported", "operator_durability.py", (), ("--sample-s", "40"), 3600, _o3),
    Bench("P5", "2-worker dist_sync aggregate ÷ single process, same 2 cores", "≥ 0.95",
          "trainer_throughput.py", ("--quick",), (), 1200, _p5),
    Bench("D1", "denormals flushed to zero ÷ IEEE denormals (bare loop of P1, LeNet + Adam)", "reported",
          "trainer_throughput.py", ("--quick",), (), 1200, _d1),
    Bench("P6", "sharding S3 → S3 ÷ raw copy of the source", "≥ 0.5",
          "shard_throughput.py", ("--quick",), (), 3600, _p6),
    Bench("P7", "DAG file parse time once Airflow is loaded", "≤ 0.5 s, nothing heavy",
          "parse_time.py", ("3",), ("10",), 600, _p7),
    Bench("P8", "price of correctness: chosen kvstore mode ÷ fastest mode (digits job)", "reported",
          "kvstore_modes.py", ("--epochs", "5"), (), 1800, _p8),
    Bench("C1", "2-bit gradient compression: bytes pushed per step, compressed ÷ plain", "≈ 1/16",
          "compression.py", ("--quick",), (), 1200, _compression),
    Bench("Q1", "wine through the DAG: test accuracy ÷ StandardScaler + LogisticRegression's, same train/test split",
          "≥ 1.0", "table_references.py", (), (), 3600, _q1),
    Bench("Q2", "diabetes regression through the DAG: test R² ÷ scikit-learn Ridge's, same train/test split",
          "≥ 1.0", "table_references.py", (), (), 3600, _q2),
    Bench("Q3", "a table with a text column and missing values (impute) through the DAG; the registered model on "
          "raw rows with unseen categories and missing values", "trains; predicts those rows",
          "table_references.py", (), (), 3600, _q3),
    Bench("Q4", "the defaults on a nonlinear regression table, features on scales 0.01-1000 (only model.task set): "
          "test R² ÷ StandardScaler + MLPRegressor's (targets scaled), same split", "≥ 1.0",
          "table_defaults.py", (), (), 1800, _q4),
    Bench("Q5", "the defaults on a three-class table, features on scales 0.01-1000: test accuracy ÷ "
          "StandardScaler + MLPClassifier's, same split", "≥ 1.0", "table_defaults.py", (), (), 1800, _q5),
    Bench("Q6", "digits job time with the defaults (epoch budget, early stopping) ÷ with the defaults of before "
          "(20 epochs)", "≤ 2.0", "table_defaults.py", (), (), 1800, _q6),
    Bench("N1", "step time against link bandwidth (tbf on every netns host link) ÷ the planner's time for "
          "the same bytes (measured comm ÷ planned, mean over the rates)", "reported",
          "constrained_links.py", ("--quick",), (), 1800, _n1),
    Bench("C2", "2-bit compression where the link is the bottleneck: wall time ÷ plain, and the accuracy it costs "
          "(anchor: BytePS ResNet-50 ×0.92 for −0.59 points)", "reported",
          "constrained_links.py", ("--quick",), (), 1800, _c2),
    Bench("G1", "goodput (productive ÷ wall training time) with kill -9 of a random role every T s, through "
          "Airflow; parameters vs an uninterrupted run", "≥ 0.97 at T = 300 s, bit-identical",
          "goodput.py", ("--epochs", "15", "--period-s", "150", "--max-kills", "1"),
          ("--compare", "10,100,1000,auto"), 10800, _g1),
    Bench("G2", "a run through Airflow that takes 20+ kill -9s of random roles (restarts in place); parameters vs an "
          "uninterrupted run", "finishes on the train task's first try, bit-identical", "goodput.py",
          ("--epochs", "20", "--period-s", "12", "--max-kills", "22", "--every-n-steps", "50"), (), 3600, _g2),
    Bench("R4", "network fault on the netns hosts backend: a worker host's link down 5 s and 30 s "
          "(stall timeout 20 s)", "short: rides it out; long: torn down by the stall detector, retry resumes",
          "chaos.py", ("--scenarios", "R4"), ("--scenarios", "R4", "--cut-s", "2,5,10,30,60"), 1500, _r4),
)


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()[0]
    gpu = "a GPU device" if os.path.exists("/dev/nvidia0") else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({model}), {mem_gib:.0f} GiB RAM, {gpu}, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}; load average {load:.1f} at start")


def run_one(bench: Bench, full: bool, cache: dict[tuple[str, ...], dict[str, Any]]) -> dict[str, Any]:
    """Run a benchmark script (once per distinct command: P2 and P3 share one) and summarise it."""
    cmd = bench.command(full)
    key = tuple(cmd)
    if key not in cache:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            out_path = fh.name
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, *cmd, "--json", out_path], cwd=REPO, capture_output=True,
                                  text=True, timeout=bench.timeout_s, env={**os.environ, "PYTHONPATH": REPO})
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                cache[key] = {"error": f"exit {proc.returncode}: {' / '.join(tail)}"}
            else:
                with open(out_path) as fh:
                    cache[key] = {"result": json.load(fh)}
        except subprocess.TimeoutExpired:
            cache[key] = {"error": f"timed out after {bench.timeout_s} s"}
        except (OSError, ValueError) as exc:
            cache[key] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            cache[key]["seconds"] = time.monotonic() - started
            if os.path.exists(out_path):
                os.unlink(out_path)
    got = cache[key]
    row: dict[str, Any] = {"id": bench.id, "measure": bench.measure, "goal": bench.goal,
                           "command": " ".join(cmd), "date": dt.date.today().isoformat(),
                           "seconds": round(got["seconds"], 1)}
    if "error" in got:
        row.update(figure=f"not measured: {got['error']}", ratio=None, met=None)
    else:
        try:
            figure, ratio, met = bench.summarise(got["result"])
            row.update(figure=figure, ratio=ratio, met=met, raw=got["result"])
        except (KeyError, TypeError, ValueError) as exc:
            row.update(figure=f"not summarised: {type(exc).__name__}: {exc}", ratio=None, met=None)
    return row


def table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [BEGIN, "", header, "",
             "| # | measure | goal | figure | ratio | met | date | command |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.3g}"
        met = {True: "yes", False: "**no**", None: "—"}[r["met"]]
        lines.append(f"| {r['id']} | {r['measure']} | {r['goal']} | {r['figure']} | {ratio} | {met} | {r['date']} "
                     f"| `{r['command']}` |")
    # The planner's model beside the measurements: those of this report's rows (N1) and the
    # figure files the longer benchmarks wrote (benchmarks/predicted.py names each).
    lines += ["", predicted.render({r["id"]: r["raw"] for r in rows if "raw" in r}), "", END]
    return "\n".join(lines)


def write_readme(block: str) -> None:
    with open(README) as fh:
        text = fh.read()
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        text = before + block + after
    else:  # first report: after the title and the introduction paragraph
        head, sep, tail = text.partition("\n\n## ")
        text = head + "\n\n" + block + "\n" + sep + tail
    with open(README, "w") as fh:
        fh.write(text)


def recorded(bench: Bench, path: str) -> dict[str, Any]:
    """The row of a result file written earlier by ``bench``'s script (``--json``): its figure,
    the command that produced it (recorded in the file) and the file's date."""
    with open(path) as fh:
        result = json.load(fh)
    when = dt.datetime.fromtimestamp(os.path.getmtime(path), dt.timezone.utc)
    command = result.get("command") or " ".join(bench.command(False))
    if not command.startswith(f"benchmarks/{bench.script}"):
        raise ValueError(f"{path} was written by `{command}`, not by benchmarks/{bench.script} ({bench.id})")
    figure, ratio, met = bench.summarise(result)
    return {"id": bench.id, "measure": bench.measure, "goal": bench.goal, "command": command,
            "date": when.date().isoformat(), "seconds": None, "figure": figure, "ratio": ratio, "met": met,
            "raw": result}


def previous_rows() -> dict[str, dict[str, Any]]:
    """The rows of the last written report (``results.json``), by id; none if there is none."""
    if not os.path.exists(RESULTS):
        return {}
    with open(RESULTS) as fh:
        return {r["id"]: r for r in json.load(fh)["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="long settings (hours on 2 cores)")
    parser.add_argument("--only", default="", help="comma-separated ids, e.g. P2,P7")
    parser.add_argument("--record", action="append", default=[], metavar="ID=FILE",
                        help="a benchmark's figure from a --json file its script wrote earlier (not run again)")
    parser.add_argument("--merge", action="store_true", help="keep the rows of results.json that are not run now")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave README.md alone")
    parser.add_argument("--rerender", action="store_true",
                        help="run nothing: the rows of results.json rendered again (the predicted vs measured "
                             "table recomputed from the figure files)")
    args = parser.parse_args()
    if args.rerender:
        with open(RESULTS) as fh:
            last = json.load(fh)
        block = table(last["rows"], last["header"])
        print(block)
        if not args.no_write:
            write_readme(block)
        return 0
    wanted = {x.strip() for x in args.only.split(",") if x.strip()}
    records = dict(item.split("=", 1) for item in args.record if "=" in item)
    if len(records) != len(args.record):
        parser.error("--record takes ID=FILE")
    unknown = (wanted | set(records)) - {b.id for b in BENCHES}
    if unknown:
        parser.error(f"unknown benchmark ids {sorted(unknown)}; known: {[b.id for b in BENCHES]}")
    # With only --record, nothing is run; --only names what is.
    to_run = wanted or (set() if records else {b.id for b in BENCHES})
    kept = previous_rows() if args.merge else {}
    header = (f"Report of `benchmarks/run{' --full' if args.full else ''}` ({'full' if args.full else 'quick'} "
              f"mode), {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, on {machine()}. Each benchmark "
              "ran on its own, one after another; ratios are side by side within one benchmark's run.")
    if not to_run:
        header = (f"Report of `benchmarks/run`, assembled {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC on "
                  f"{machine().split(';')[0]} from result files of the scripts run by hand (`--record`)"
                  f"{' and the rows of the previous report (`--merge`)' if kept else ''}.")
    if kept or records:
        header += (" Rows not measured by this report's own runs are kept from earlier ones or recorded from a "
                   "script's result file: each row's date and command say when and how it was measured.")
    cache: dict[tuple[str, ...], dict[str, Any]] = {}
    rows = []
    for bench in BENCHES:
        if bench.id in records:
            rows.append(recorded(bench, records[bench.id]))
        elif bench.id in to_run:
            print(f"==> {bench.id}: {' '.join(bench.command(args.full))}", flush=True)
            rows.append(run_one(bench, args.full, cache))
        elif bench.id in kept:
            rows.append(kept[bench.id])
            continue
        else:
            continue
        print(f"    {bench.id}: {rows[-1]['figure']} (ratio {rows[-1]['ratio']}, met {rows[-1]['met']}, "
              f"{rows[-1]['seconds']} s)", flush=True)
    block = table(rows, header)
    print(block)
    if not args.no_write:
        write_readme(block)
        with open(RESULTS, "w") as fh:
            json.dump({"header": header, "rows": rows}, fh, indent=2, default=str)
    return 0 if all(r["met"] is not False and "raw" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
