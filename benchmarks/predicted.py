"""The planner's predictions (``infra.perf_model``) beside the project's measurements: the
"predicted vs measured" table of the benchmark report (``benchmarks/run.py`` renders it).

Each line is one quantity at one or more sizes: what the model gives for the job as it was
run (its workers, servers, bytes, link, cores, and where the model needs them the measured
inputs it takes: a job's wall time, its compute step, the loopback rate at the time), the
measured figure, and measured ÷ predicted; the goal is 0.8-1.2 for every point. Each line says
what it tests (``basis``): *check*, no constant of the model came from that figure; *form*, the
model's constants were fitted over these points (least squares over the sizes): the ratios test
the model's shape; *fit*, a constant was solved on that very figure: it checks the arithmetic.

Sources: ``benchmarks/many_roles.json`` (medians per size), ``benchmarks/figures/big_model-*.json``,
``benchmarks/figures/mapped_shard-112mb*.json``, ``benchmarks/figures/constrained_links-512x512.json``,
``benchmarks/big_data.json``
and the N1 row's raw figures of the report (``benchmarks/results.json``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any

# The checkout on the path (run as ``python benchmarks/predicted.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra import perf_model as pm  # noqa: E402
from testkit import REPO  # noqa: E402
from testkit.netns_hosts import tbf_burst_bytes  # noqa: E402
from testkit.server_load import imbalance, mlp_keys  # noqa: E402

BENCH = os.path.join(REPO, "benchmarks")
FEATURES, CLASSES = 64, 10  # the digits MLPs of every benchmark below
CORES = 2  # the machine every figure was measured on
LOW, HIGH = 0.8, 1.2


@dataclass(frozen=True)
class Line:
    quantity: str
    case: str
    predicted: list[float]
    measured: list[float]
    unit: str
    source: str
    basis: str = "check"  # check | form | fit (module docstring)

    @property
    def ratios(self) -> list[float]:
        return [m / p for p, m in zip(self.predicted, self.measured)]

    @property
    def within(self) -> bool:
        return all(LOW <= r <= HIGH for r in self.ratios)


def _load(path: str) -> dict[str, Any] | None:
    full = os.path.join(BENCH, path)
    if not os.path.exists(full):
        return None
    with open(full) as fh:
        return json.load(fh)


def many_roles(d: dict[str, Any]) -> list[Line]:
    sizes = d["sizes"]
    case = "W+S = " + ", ".join(f"{s['workers']}+{s['servers']}" for s in sizes) + f" (+1 scheduler), {CORES} cores"
    src = "many_roles.json"
    procs = [s["workers"] + s["servers"] + 1 for s in sizes]
    med = [s["median"] for s in sizes]
    wall = [statistics.median(r["job_a_wall_s"] for r in s["runs"]) for s in sizes]
    detect = [statistics.mean(x for r in s["runs"] for x in (r["worker_kill_detect_s"], r["server_kill_detect_s"]))
              for s in sizes]
    ckpt = _checkpoint_bytes(sizes)
    return [
        Line("time to the first step", case, [pm.first_step_s(n, CORES) for n in procs],
             [m["first_step_s"] for m in med], "s", src, "form"),
        Line("supervisor CPU over job A (its measured wall)", case,
             [pm.supervisor_cpu_s(n, w) for n, w in zip(procs, wall)], [m["supervisor_cpu_s"] for m in med], "CPU-s",
             src, "form"),
        Line("supervisor peak RSS", case, [pm.supervisor_rss_mb(n) for n in procs],
             [m["supervisor_peak_rss_mb"] for m in med], "MB", src, "form"),
        Line("supervisor peak threads", case, [float(pm.supervisor_threads(n)) for n in procs],
             [m["supervisor_peak_threads"] for m in med], "", src, "form"),
        Line("failure detection (mean of the worker and server kills)", case, [pm.detect_s() for _ in procs],
             detect, "s", src, "form"),
        Line(f"restore, every worker at once ({ckpt[-1] / 1e3:.0f} kB, local storage)", case,
             [pm.restore_s(b, s["workers"], CORES) for b, s in zip(ckpt, sizes)], [m["restore_s"] for m in med], "s",
             src, "form"),
        # The saves of job B (its fewer workers), every worker released at the checkpoint's step.
        # SAVE_LATENCY_S is the mean of the first three sizes: "form"; the burst's constants and
        # SAVE_CPU_S came from other measurements (many_roles-d.json, a save alone).
        Line("checkpoint save (rank 0; the other workers released together at its step)", case,
             save_after_burst(ckpt, sizes), [m["checkpoint_save_s"] for m in med], "s", src, "form"),
    ]


def _checkpoint_bytes(sizes: list[dict[str, Any]]) -> list[float]:
    """One checkpoint's bytes per size (median over runs): the uploader's "bytes" add up every
    committed save's files (training.checkpoint.uploader), so one is that ÷ "committed" (31 kB of
    the MLP's arrays, not the 1.7 MB of 55 saves)."""
    return [statistics.median(r["checkpoint_stats"]["bytes"] / max(1, r["checkpoint_stats"]["committed"])
                              for r in s["runs"]) for s in sizes]


def save_after_burst(ckpt: list[float], sizes: list[dict[str, Any]]) -> list[float]:
    """``checkpoint_step_save_s`` for each size's job B (its elastic worker count)."""
    return [pm.checkpoint_step_save_s(b, s["runs"][0]["elastic_workers"], CORES) for b, s in zip(ckpt, sizes)]


def many_roles_quiet(d: dict[str, Any], name: str) -> list[Line]:
    """The save line of a many_roles run on the quiet machine, with the threads runnable during
    the saves it measured (its 24+8 burst gave SAVE_BURST_*: "fit")."""
    sizes = d["sizes"]
    ckpt = _checkpoint_bytes(sizes)
    busy = " / ".join(f"{s['median']['save_runnable']:.1f}" for s in sizes)
    case = ("W+S = " + ", ".join(f"{s['workers']}+{s['servers']}" for s in sizes)
            + f", job B on {' / '.join(str(s['runs'][0]['elastic_workers']) for s in sizes)} workers; quiet machine; "
            f"{busy} threads runnable during the saves, measured")
    return [Line("checkpoint save (rank 0; the other workers released together at its step)", case,
                 save_after_burst(ckpt, sizes), [s["median"]["checkpoint_save_s"] for s in sizes], "s", name, "fit")]


def _sizes(d: dict[str, Any]) -> list[int]:
    return [size for _, size in mlp_keys(FEATURES, d["hidden"], CLASSES)]


def _busy(runnable: float | None) -> str:
    return f"{runnable:.1f} threads runnable, measured" if runnable is not None else "the job's own processes"


def big_model(d: dict[str, Any], name: str) -> list[Line]:
    p, sizes, w, s = d["planner"], _sizes(d), d["workers"], d["servers_used"]
    load = max(d.get("load_avg_before", [0])[0], d.get("load_avg_after", [0])[0])
    case = (f"{d['params'] / 1e6:.1f} M params, {w} workers, {s} servers, loopback "
            f"{p['loopback_bytes_per_s'] / 1e9:.2f} GB/s, load average up to {load:.0f}")
    comm = pm.comm_s(sizes, w, s, pm.Link(p["loopback_bytes_per_s"], shared=True), d.get("bigarray_bound") or
                     pm.DEFAULT_BIGARRAY_BOUND)
    # LOOPBACK_PS_COST is the mean of the two 100 M runs, PER_KEY_S solved on the (64, 64) MLP;
    # any other run is a check.
    basis = {"figures/big_model-100m.json": "form", "figures/big_model-100m-run-b.json": "form",
             "figures/big_model-mlp64x64.json": "fit"}.get(name, "check")
    lines = [Line("communication per step (step − compute)", case, [comm], [p["measured_comm_s_per_step"]], "s", name,
                  basis)]
    if d["params"] < 1e6:
        return lines
    # The save runs beside the job: both workers, the servers for their share of the step
    # (communication ÷ step, predicted), the uploader and the local S3 server want the cores.
    step = p["compute_step_s"] + comm
    # Who wants the cores during a save: the runnable threads measured then (testkit.run_queue;
    # newer files), else the job's own: both workers, the servers for their share of the step
    # (communication ÷ step, predicted), the uploader and the local S3 server.
    measured_busy = d["checkpoint"].get("runnable_median")
    busy = measured_busy if measured_busy is not None else w + s * comm / step + 1 + 1
    restore_busy = d["restore"].get("runnable")
    nbytes = pm.checkpoint_bytes(d["params"], 1)  # SGD with momentum: one state value per parameter
    pred_share = imbalance(pm.server_elements(sizes, s, d["bigarray_bound"]))
    lines += [
        Line("checkpoint bytes (params + momentum)", case, [nbytes], [d["checkpoint"]["bytes"]], "B", name),
        Line(f"checkpoint save (median, beside training; {_busy(measured_busy)})", case,
             [pm.save_s(nbytes, busy, CORES)], [d["checkpoint"]["save_upload_s_median"]], "s", name),
        Line(f"restore (2 workers at once, local S3; {_busy(restore_busy)})", case,
             [pm.restore_s(nbytes, w, CORES, storage_procs=1, runnable=restore_busy)],
             [d["restore"]["restore"]], "s", name),
        Line("largest server ÷ mean, traffic (ss)", case, [pred_share], [d["received_imbalance"]], "", name),
    ]
    return lines


def constrained_links(r: dict[str, Any], source: str = "results.json N1") -> list[Line]:
    sweep = r["sweep"]
    workers, servers = r.get("workers", 2), r.get("servers", 1)  # the script's job (older files lack them)
    sizes = [size for _, size in mlp_keys(FEATURES, r.get("hidden", [256, 256]), CLASSES)]
    rates = [p["rate_mbit"] for p in sweep]
    pred = [pm.bandwidth_s(sizes, workers, servers, pm.Link(x * 1e6 / 8, tbf_burst_bytes(x))) for x in rates]
    hidden = "×".join(str(h) for h in r.get("hidden", [256, 256]))
    case = (f"MLP 64→{hidden}→10, {workers} workers, {servers} server, tbf at " + ", ".join(f"{x:g}" for x in rates)
            + " Mbit/s")
    return [Line("communication per step (step − unconstrained step)", case, pred,
                 [p["measured_comm_s"] for p in sweep], "s", source)]


# Runs of the data step whose cores, not their chains, bound them: other work shared the machine.
# c recorded its runnable threads (13-15); a and b recorded none, and every step of theirs took
# 1.6-2.5× what it took on the quiet machine (d, 2.5-3.2 threads runnable: the job's own).
QUIET = "figures/mapped_shard-112mb-d.json"
LOADED_SHARD_RUNS = {"figures/mapped_shard-112mb.json", "figures/mapped_shard-112mb-b.json",
                     "figures/mapped_shard-112mb-c.json"}


def _shard_2_over_1(d: dict[str, Any], name: str, runs: dict[int, dict[str, Any]]) -> float:
    """The model's 2 parts ÷ 1 part on one 2-core host: on a quiet host each part a chain on a
    core of its own (``shard_s``); on a loaded one the step's CPU (``shard_cpu_s``), times the
    change of runnable threads between the two runs where the file records them."""
    mb = d["source_mb"]
    if name not in LOADED_SHARD_RUNS:
        return pm.shard_s(mb, 2, CORES / 2) / pm.shard_s(mb, 1)
    load = runs[2]["runnable"] / runs[1]["runnable"] if runs[1].get("runnable") else 1.0
    return pm.shard_cpu_s(mb, 2) / pm.shard_cpu_s(mb, 1) * load


def mapped_shard(d: dict[str, Any], name: str) -> list[Line]:
    runs = {r["parts"]: r for r in d["runs"]}
    order = " then ".join(str(r["parts"]) for r in d["runs"])
    loaded = name in LOADED_SHARD_RUNS
    host = "loaded host" if loaded else "quiet host"
    out = []
    for n in sorted(runs):
        # The time constants (SHARD_*, TASK_START_S, SHARD_PART_CORES) came from the quiet run d's
        # 1 part: that line is "fit"; d's 2 parts and every other run are checks. (The CPU model's
        # SHARD_PART_CPU_S came from d's 2 parts' CPU clocks; it predicts only the loaded runs.)
        basis = "fit" if n == 1 and name == QUIET else "check"
        runnable = runs[n].get("runnable")
        case = (f"{d['source_mb']:.0f} MB CSV, " + (f"{n} parts side by side" if n > 1 else "1 part")
                + f" on {CORES} cores, {host} (runs: {order}"
                + (f"; {runnable:.1f} threads runnable, measured, not in the model)" if runnable is not None else ")"))
        predicted = pm.shard_s(d["source_mb"], 1)
        if n > 1:
            predicted *= _shard_2_over_1(d, name, runs)
        out.append(Line("data step, plan → merge", case, [predicted], [runs[n]["total_s"]], "s", name, basis))
    if 1 in runs and 2 in runs:
        # The same host's load moves both runs alike (minutes apart): their ratio is what the
        # model says a second part costs or gains on one host.
        load = "; the change of runnable threads between the runs in" if runs[1].get("runnable") and loaded else ""
        out.append(Line("data step, 2 parts ÷ 1 part on one host", f"{d['source_mb']:.0f} MB CSV, {CORES} cores, "
                        f"{host} (runs: {order}{load})", [_shard_2_over_1(d, name, runs)],
                        [runs[2]["total_s"] / runs[1]["total_s"]], "", name,
                        "fit" if name == QUIET else "check"))  # d's ratio divides by its 1 part, the fit
    return out


BIG_DATA_FIT_BYTES = 20_217_643_800  # the run whose count and merge fitted perf_model's Parquet count and merge


def _mean_task_s(run: dict[str, Any], task: str) -> float | None:
    """The mean span of a task (of its mapped instances), where the run recorded task spans."""
    got = [v["seconds"] for k, v in run["tasks"].items() if (k == task or k.startswith(task + "[")) and "seconds" in v]
    return statistics.mean(got) if got else None


def big_data(d: dict[str, Any], name: str) -> list[Line]:
    """The shard stage of ``big_data.py``'s runs through the DAG, Parquet files cut into
    ``shard_parts`` groups side by side on the 2 cores, whole and step by step (a part's count and
    shard: the mean of the parts). Every size is a check but for the 20.2 GB run's count and
    merge, which fitted the Parquet count and the merge's rate per MB of shards
    (``perf_model.SHARD_COUNT_PARQUET_S_PER_MB``, ``SHARD_MERGE_S_PER_SHARD_MB``); with them its
    whole stage is a fit too. (The recorded runs had the machine to themselves; the model has no
    term for other work.)"""
    runs = [r for r in d["runs"] if "shard" in r["stages"]]
    out = []
    for quantity, task, step in (("data step through the DAG, plan → merge", None, None),
                                 ("a part's count (mean of the parts)", "shard_count", "count"),
                                 ("a part's shard (mean of the parts)", "shard_part", "shard"),
                                 ("merge", "shard_merge", "merge")):
        for basis in ("check", "fit"):
            pred, meas, sizes = [], [], []
            for r in runs:
                fitted = r["table"]["bytes"] == BIG_DATA_FIT_BYTES and step != "shard"
                if fitted != (basis == "fit"):
                    continue
                parts = r.get("parts", 2)  # the script's default, which every run before the field used
                steps = pm.shard_steps_s(r["table"]["bytes"] / 1e6, parts, CORES / parts, "parquet")
                got = r["stages"]["shard"]["seconds"] if task is None else _mean_task_s(r, task)
                if got is None:
                    continue
                pred.append(sum(steps.values()) if step is None else steps[step])
                meas.append(got)
                sizes.append(f"{r['table']['bytes'] / 1e9:.1f}")
            if pred:
                out.append(Line(quantity, f"Parquet, {parts} parts side by side on {CORES} cores, quiet host; "
                                + " / ".join(sizes) + " GB", pred, meas, "s", name, basis))
    return out


def lines(report_rows: dict[str, dict[str, Any]] | None = None) -> list[Line]:
    """Every comparison whose measurement is recorded; ``report_rows`` are the report's raw
    results by id (N1's comes from there, else from ``results.json``)."""
    out: list[Line] = []
    if (d := _load("many_roles.json")) is not None:
        out += many_roles(d)
    if (d := _load("figures/many_roles-d.json")) is not None:
        out += many_roles_quiet(d, "figures/many_roles-d.json")
    for name in ("figures/big_model-100m.json", "figures/big_model-100m-run-b.json", "figures/big_model-9m.json",
                 "figures/big_model-9m-b.json", "figures/big_model-9m-c.json", "figures/big_model-mlp64x64.json"):
        if (d := _load(name)) is not None:
            out += big_model(d, name)
    n1 = (report_rows or {}).get("N1")
    if n1 is None and (res := _load("results.json")) is not None:
        n1 = next((row.get("raw") for row in res["rows"] if row["id"] == "N1"), None)
    if n1 and "sweep" in n1:
        out += constrained_links(n1)
    for name in ("figures/constrained_links-512x512.json",):
        if (d := _load(name)) is not None and "sweep" in d:
            out += constrained_links(d, name)
    for name in ("figures/mapped_shard-112mb.json", "figures/mapped_shard-112mb-b.json",
                 "figures/mapped_shard-112mb-c.json", "figures/mapped_shard-112mb-d.json",
                 "figures/mapped_shard-112mb-e.json"):
        if (d := _load(name)) is not None:
            out += mapped_shard(d, name)
    if (d := _load("big_data.json")) is not None:
        out += big_data(d, "big_data.json")
    return out


def _fmt(values: list[float], unit: str) -> str:
    def one(v: float) -> str:
        if unit == "B":
            return f"{v / 1e6:,.1f} MB"
        return f"{v:.3g}"
    return " / ".join(one(v) for v in values) + (f" {unit}" if unit and unit != "B" else "")


def render(report_rows: dict[str, dict[str, Any]] | None = None) -> str:
    got = lines(report_rows)
    counts = {b: (sum(ln.within for ln in got if ln.basis == b), sum(ln.basis == b for ln in got))
              for b in ("check", "form", "fit")}
    head = ["### Predicted vs measured (`infra/perf_model.py`)", "",
            "The planner's time model beside each recorded measurement (`benchmarks/predicted.py`). Within "
            "0.8-1.2 at every point: " + ", ".join(f"{i} of {n} {b} lines" for b, (i, n) in counts.items() if n) +
            " (*check*: no constant came from that figure; *form*: constants fitted over these points; *fit*: a "
            "constant solved on it).", "",
            "| quantity | case | predicted | measured | measured ÷ predicted | within ±20 % | basis | source |",
            "|---|---|---|---|---|---|---|---|"]
    for ln in got:
        ratios = " / ".join(f"{r:.2f}" for r in ln.ratios)
        ok = "yes" if ln.within else "**no**"
        head.append(f"| {ln.quantity} | {ln.case} | {_fmt(ln.predicted, ln.unit)} | {_fmt(ln.measured, ln.unit)} "
                    f"| {ratios} | {ok} | {ln.basis} | `{ln.source}` |")
    return "\n".join(head)


if __name__ == "__main__":
    print(render())
