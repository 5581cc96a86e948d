"""What a mapped part's read of its byte range costs, apart from parsing: 1 reader of the whole
CSV against N readers of 1/N each, side by side (``benchmarks/mapped_shard.py``'s parts, the bytes
only), from a SeaweedFS S3 server of its own on the same cores.

    .venv/bin/python benchmarks/range_reads.py --rows 40000   # the 111.8 MB CSV of mapped_shard-112mb

Each reader is a child process that reads its range exactly as a part's ``count`` does
(``data_checks.sources.open_stream`` with the plan's span: the line-start probes at both ends,
the header, then the range, hashed), in phases: ``setup`` (imports of the reading path, the S3
filesystem, ``plan_source``'s listing), ``open`` (the two line-start probes), ``read`` (the
bytes). Per phase: wall and the process's CPU seconds; per configuration the SeaweedFS server's
CPU seconds and the bytes it was asked for (the readahead cache's fetches, from fsspec's cache
statistics). Prints a table and a JSON line (``RESULT {...}``). Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.mapped_shard import store_cpu_s, upload_source  # noqa: E402
from benchmarks.shard_throughput import with_s3  # noqa: E402

from testkit import REPO  # noqa: E402
from testkit.result_file import write_json  # noqa: E402

CHILD = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from data_checks import parts, sources
plan = sources.plan_source(sys.argv[1])
k, n = int(sys.argv[2]), int(sys.argv[3])
[f] = plan.files
span = parts._cut(plan, n)[k]["span"]
head = sources.read_head(f, 1 << 16)
header = head.index(b"\\n") + 1
t1, c1 = time.perf_counter(), time.process_time()
fetched = 0
with sources.open_stream(f, span=tuple(span), header=header) as stream:
    t2, c2 = time.perf_counter(), time.process_time()
    got = 0
    while block := stream.read(4 << 20):
        got += len(block)
    raw = stream._raw._raw
    fetched = getattr(raw.cache, "total_requested_bytes", None)
    t3, c3 = time.perf_counter(), time.process_time()
print("CHILD " + json.dumps({"bytes": got, "fetched_bytes": fetched,
                             "setup": [t1 - t0, c1 - c0], "open": [t2 - t1, c2 - c1], "read": [t3 - t2, c3 - c2]}))
"""


def readers(source: str, n: int, env: dict[str, str]) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, source, str(k), str(n)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=env) for k in range(n)]
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"reader failed ({proc.returncode})")
        out.append(json.loads(next(ln for ln in text.splitlines() if ln.startswith("CHILD "))[6:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 1, 2])
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    result = with_s3("range-reads-", lambda bucket, home, env: bench(bucket, home, args, env))
    print("RESULT " + json.dumps(result))
    write_json(args.json, result)


def bench(bucket: str, home: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    source, size = upload_source(bucket, home, args.rows, args.features)
    runs = []
    print("| readers | reader | setup wall / CPU s | probes wall / CPU s | read wall / CPU s | MB read | MB fetched |"
          " SeaweedFS CPU s | all wall s |\n|---|---|---|---|---|---|---|---|---|")
    for n in args.parts:
        before, t = store_cpu_s(home), time.perf_counter()
        got = readers(source, n, env)
        wall, store = time.perf_counter() - t, store_cpu_s(home) - before
        runs.append({"readers": n, "wall_s": round(wall, 2), "store_cpu_s": round(store, 2), "each": got})
        for k, r in enumerate(got):
            fetched = f"{r['fetched_bytes'] / 1e6:.1f}" if r["fetched_bytes"] is not None else "?"
            print(f"| {n} | {k} | " + " | ".join(f"{r[p][0]:.2f} / {r[p][1]:.2f}" for p in ("setup", "open", "read"))
                  + f" | {r['bytes'] / 1e6:.1f} | {fetched} | {store:.2f} | {wall:.2f} |", flush=True)
    return {"rows": args.rows, "features": args.features, "source_mb": round(size / 1e6, 1), "cpus": os.cpu_count(),
            "runs": runs}


if __name__ == "__main__":
    main()
