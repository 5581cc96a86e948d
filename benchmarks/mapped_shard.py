"""Mapped sharding (``data_checks.parts``), 1 part against 2, S3 → S3: wall time and peak RSS per task.

    .venv/bin/python benchmarks/mapped_shard.py              # 110k rows × 256 float32 (~300 MB CSV)
    .venv/bin/python benchmarks/mapped_shard.py --rows 20000 # a quick look

Starts its own SeaweedFS S3 server (as ``shard_throughput.py``) and stops it at the end. For each
part count, every step the DAG runs as a task runs here as a child process: ``plan``, then the
parts' ``count`` children at once, then the parts' ``shard_part`` children at once, then
``merge``; each child's wall time (with the interpreter's start and imports, as a task pays them), the
step's own time, its CPU seconds (all of it from ``wait4``, and the step's own from the child's
process clock, with the busiest threads' share: how many cores a part really uses) and its
peak RSS (its own ``wait4`` rusage) are printed, and the SeaweedFS server's CPU seconds over each
step (it serves every byte the parts read, on the same cores). The two
runs' shards must have the same sha256 (checked). The source is one CSV file, cut by byte ranges
for 2 parts. The machine's cores are shared: 2 parts run side by side on what is free, and the
machine's runnable threads are sampled over each run (``testkit.run_queue``) for the planner.

Prints a table and a JSON line (``RESULT {...}``). Not a timed test.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.shard_throughput import generate_csv, with_s3  # noqa: E402

from testkit import REPO  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.run_queue import RunQueueSampler  # noqa: E402

CHILD = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
from common.config import TrainConfig
from data_checks import parts
cfg = TrainConfig.from_json(sys.argv[1])
step, where, k = sys.argv[2], sys.argv[3], int(sys.argv[4])
t, cpu = time.perf_counter(), time.process_time()
if step == "plan":
    out = parts.plan(cfg, where, k, "bench")
elif step == "count":
    out = parts.count(cfg, where, k)
elif step == "part":
    out = parts.shard_part(cfg, where, k)
else:
    m = parts.merge(cfg, where)
    out = {"rows": m["stats"]["rows"], "sha256": {s["name"]: s["files"]["rec"]["sha256"] for s in m["shards"]}}
# The step's own CPU (every thread), and per thread still alive (psutil): how many cores one part uses.
import psutil
threads = sorted((round(th.user_time + th.system_time, 2) for th in psutil.Process().threads()), reverse=True)
print("CHILD " + json.dumps({"out": out, "seconds": time.perf_counter() - t, "work_cpu_s": time.process_time() - cpu,
                             "thread_cpu_s": threads[:6]}))
"""


def run_children(argvs: list[list[str]], env: dict[str, str], log_dir: str, timeout: float) -> list[dict]:
    """Run the children at once; per child: its CHILD json, wall seconds and peak RSS (MB)."""
    started = time.perf_counter()
    procs = []
    for i, argv in enumerate(argvs):
        err = open(os.path.join(log_dir, f"{argv[1]}-{i}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE, stderr=err,
                                       text=True, cwd=REPO, env=env), err))
    results = []
    deadline = started + timeout
    for proc, err in procs:
        out = proc.stdout.read() if proc.stdout else ""
        # wait4: this child's own rusage (its peak RSS), not the running maximum of all children.
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                raise TimeoutError(f"{argvs} did not end in {timeout} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.close()
        if proc.returncode != 0:
            with open(err.name) as fh:
                raise RuntimeError(f"child {proc.args[3:]} failed ({proc.returncode}):\n{fh.read()[-3000:]}")
        line = next(ln for ln in out.splitlines() if ln.startswith("CHILD "))
        got = json.loads(line[len("CHILD "):])
        # CPU seconds (user + system, every thread of the child): ÷ wall, the cores it really used.
        results.append({**got, "wall_s": round(time.perf_counter() - started, 2),
                        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                        "peak_rss_mb": round(usage.ru_maxrss / 1024)})
    return results


def store_cpu_s(home: str) -> float:
    """CPU seconds (user + system) so far of the SeaweedFS server serving ``home`` (``weed mini
    -dir={home}/s3``): it runs on the same cores as the parts and serves every byte they read."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        if any(arg.startswith(f"-dir={home}") for arg in proc.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):
                cpu = proc.cpu_times()
                total += cpu.user + cpu.system
    return total


def one_run(cfg_json: str, root: str, n: int, env: dict[str, str], log_dir: str, rq: RunQueueSampler,
            home: str) -> dict:
    t, wall0 = time.perf_counter(), time.time()
    store: dict[str, float] = {}

    def step(name: str, argvs: list[list[str]], timeout: float) -> list[dict]:
        before = store_cpu_s(home)
        got = run_children(argvs, env, log_dir, timeout)
        store[name] = round(store_cpu_s(home) - before, 2)
        return got

    [planned] = step("plan", [[cfg_json, "plan", root, str(n)]], 600)
    plan_uri, indices = planned["out"]["plan_uri"], planned["out"]["parts"]
    counts = step("count", [[cfg_json, "count", plan_uri, str(k)] for k in indices], 3600)
    pieces = step("shard_part", [[cfg_json, "part", plan_uri, str(k)] for k in indices], 3600)
    [merged] = step("merge", [[cfg_json, "merge", plan_uri, "0"]], 3600)
    total = time.perf_counter() - t
    steps = {"plan": [planned], "count": counts, "shard_part": pieces, "merge": [merged]}
    # Runnable threads on the machine over the run (the planner's fair share of the cores takes it).
    return {"parts": len(indices), "total_s": round(total, 2), "rows": merged["out"]["rows"],
            "runnable": rq.mean(wall0, time.time()),
            "sha256": merged["out"]["sha256"],
            "steps": {name: [{"wall_s": r["wall_s"], "work_s": round(r["seconds"], 2), "cpu_s": r["cpu_s"],
                              "work_cpu_s": round(r["work_cpu_s"], 2), "thread_cpu_s": r["thread_cpu_s"],
                              "peak_rss_mb": r["peak_rss_mb"]}
                             for r in runs]
                      for name, runs in steps.items()},
            "store_cpu_s": store}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=110_000, help="rows to generate (default 110,000: ~300 MB)")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="planned workers = train shards")
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()

    result = with_s3("mapped-shard-bench-", lambda bucket, home, env: bench(bucket, home, args, env))
    print("RESULT " + json.dumps(result))
    write_json(args.json, result)


def upload_source(bucket: str, home: str, rows: int, features: int) -> tuple[str, int]:
    """The generated CSV (``generate_csv``) in the bucket: its URI and size in bytes."""
    from common import storage

    local = os.path.join(home, "source.csv")
    size = generate_csv(local, rows, features)
    source = f"s3://{bucket}/bench/source.csv"
    storage.upload_file(local, source)
    os.unlink(local)
    print(f"generated and uploaded {size / 1e6:.0f} MB ({rows} rows × {features} float32)", flush=True)
    return source, size


def bench(bucket: str, home: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    from common.config import ClusterConfig, DataConfig, TrainConfig

    source, size = upload_source(bucket, home, args.rows, args.features)
    cfg = TrainConfig(data=DataConfig(source_uri=source, chunk_rows=args.chunk_rows),
                      cluster=ClusterConfig(num_workers=args.workers))
    runs = []
    with RunQueueSampler() as rq:
        for n in args.parts:
            log_dir = os.path.join(home, f"logs-{n}")
            os.makedirs(log_dir)
            run = one_run(cfg.to_json(), f"s3://{bucket}/bench/parts-{n}", n, env, log_dir, rq, home)
            runs.append(run)
            print(f"{n} part(s): {run['total_s']:.1f} s in all, {size / 1e6 / run['total_s']:.1f} MB/s, "
                  f"{run['runnable']:.1f} threads runnable on average", flush=True)
    identical = all(r["sha256"] == runs[0]["sha256"] for r in runs)
    print("\n| parts | step | task | wall s | of it, the step's own work s | CPU s (of the work) | "
          "busiest threads, CPU s | peak RSS MB |\n|---|---|---|---|---|---|---|---|")
    for run in runs:
        for step, tasks in run["steps"].items():
            for i, t in enumerate(tasks):
                print(f"| {run['parts']} | {step} | {i} | {t['wall_s']} | {t['work_s']} | {t['cpu_s']} "
                      f"({t['work_cpu_s']}) | {t['thread_cpu_s'][:3]} | {t['peak_rss_mb']} |")
            print(f"| {run['parts']} | {step} | SeaweedFS | | | {run['store_cpu_s'][step]} | | |")
        print(f"| {run['parts']} | all | | {run['total_s']} | | | | |")
    print(f"\nshards identical across part counts: {identical}")
    if not identical:
        raise SystemExit("the shards differ between part counts")
    return {"rows": args.rows, "features": args.features, "source_mb": round(size / 1e6, 1),
            "train_shards": args.workers, "chunk_rows": args.chunk_rows, "cpus": os.cpu_count(),
            "identical": identical, "runs": [{k: v for k, v in r.items() if k != "sha256"} for r in runs]}


if __name__ == "__main__":
    main()
