"""Sharding and validation throughput, S3 → S3, against a raw copy of the same bytes.

    .venv/bin/python benchmarks/shard_throughput.py            # 1M rows × 256 float32 (~2.8 GB CSV)
    .venv/bin/python benchmarks/shard_throughput.py --quick    # ~36k rows (~100 MB CSV)

Starts its own SeaweedFS S3 server (``infra.s3_service``: free ports, a temp folder) and stops it
at the end. Steps, each measured on its own:

1. generate a CSV (label + N float32 columns) locally and upload it (not timed);
2. raw copy: stream the object from S3 into a new object through the same boto3 client
   (GET → multipart PUT), the I/O floor any sharder pays;
3. shard: ``data_checks.shard.shard_dataset`` from that object to an S3 prefix, in a child
   process, so its peak RSS is its own;
4. validate: every shard's GX suite (``validate_shard``, no Data Docs) in a child process:
   rows/s per shard.

Prints a table and a JSON line (``RESULT {...}``). Not a timed test; numbers go to README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit import REPO  # noqa: E402
from testkit.result_file import write_json  # noqa: E402

CHILD_SHARD = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
from data_checks.shard import shard_dataset
from common.config import TrainConfig
cfg = TrainConfig.from_json(sys.argv[1])
t = time.perf_counter()
manifest = shard_dataset(cfg, sys.argv[2], work_dir=sys.argv[3])
print("CHILD " + json.dumps({"seconds": time.perf_counter() - t, "rows": manifest["stats"]["rows"],
      "shards": [[s["name"], s["count"], s["files"]["rec"]["bytes"]] for s in manifest["shards"]]}))
"""

CHILD_VALIDATE = """
import json, logging, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from data_checks.validate import validate_shard
from common.manifest import load_manifest
from common.config import TrainConfig
cfg = TrainConfig.from_json(sys.argv[1])
manifest = load_manifest(sys.argv[2])
validate_shard(sys.argv[2], manifest["shards"][-1]["name"], cfg, manifest=manifest)  # warm-up: GX's first run
out = []
for s in manifest["shards"]:
    r = validate_shard(sys.argv[2], s["name"], cfg, manifest=manifest).result
    out.append({"shard": s["name"], "rows": r["rows"], "seconds": r["seconds"], "rows_per_s": r["rows_per_s"],
                "success": r["success"]})
print("CHILD " + json.dumps(out))
"""


def run_child(code: str, *args: str, env: dict[str, str], timeout: float) -> tuple[dict | list, float, float]:
    """Run ``code`` in a child; returns (its CHILD json, wall seconds, peak RSS in MB)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    wall = time.perf_counter() - started
    # The child has been waited for by communicate(); its rusage is in RUSAGE_CHILDREN only as a
    # running maximum, so the shard child runs first and the maximum is read right after it.
    import resource

    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-3000:]}")
    sys.stderr.write("\n".join(line for line in err.splitlines() if "data_checks" in line)[-2000:] + "\n")
    line = next(ln for ln in out.splitlines() if ln.startswith("CHILD "))
    return json.loads(line[len("CHILD "):]), wall, peak_mb


def generate_csv(path: str, rows: int, features: int, seed: int = 0) -> int:
    """label + ``features`` float32 columns. Float formatting is slow, so 10,000 random rows are
    rendered once and repeated: the parse work per row is the same as for distinct rows."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(seed)
    block = min(rows, 10_000)
    X = rng.standard_normal((block, features), dtype=np.float32)
    table = pa.table({"label": rng.integers(0, 10, block), **{f"f{i}": X[:, i] for i in range(features)}})
    buf = io.BytesIO()
    pcsv.write_csv(table, buf)
    text = buf.getvalue()
    header, body = text[:text.index(b"\n") + 1], text[text.index(b"\n") + 1:]
    lines = body.splitlines(keepends=True)
    with open(path, "wb") as out:
        out.write(header)
        for _ in range(rows // block):
            out.write(body)
        out.write(b"".join(lines[:rows % block]))
    return os.path.getsize(path)


def raw_copy(source: str, dest: str) -> float:
    """GET the source and PUT it as a new object (boto3 managed multipart), timed."""
    from common import storage

    client = storage.s3_client()
    sb, sk = storage.split_s3(source)
    db, dk = storage.split_s3(dest)
    started = time.perf_counter()
    body = client.get_object(Bucket=sb, Key=sk)["Body"]
    client.upload_fileobj(body, db, dk)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~100 MB of CSV instead of ~2.8 GB")
    parser.add_argument("--rows", type=int, help="rows to generate (default 1,000,000; --quick: 36,000)")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="planned workers = train shards")
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    rows = args.rows or (36_000 if args.quick else 1_000_000)

    result = with_s3("shard-bench-", lambda bucket, home, env: bench(bucket, home, rows, args, env))
    print("RESULT " + json.dumps(result))
    write_json(args.json, result)


def with_s3(prefix: str, run: Callable[[str, str, dict[str, str]], dict]) -> dict:
    """``run(bucket, home, env)`` against a SeaweedFS S3 server of its own (free ports, a temp
    folder ``home``), stopped and removed after it; ``env``: a child's environment to reach it."""
    from infra.s3_service import start_s3, stop_s3
    from infra.stack_config import StackConfig, stack_env

    home = tempfile.mkdtemp(prefix=prefix)
    stack = StackConfig.with_free_ports(home)
    stack.save()
    handle = start_s3(stack)
    try:
        env = {**os.environ, **{k: v for k, v in stack_env(stack.home).items() if k.startswith("AWS_")},
               "PYTHONPATH": REPO}
        env.pop("AWS_ENDPOINT_URL", None)
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        result = run(stack.bucket, home, env)
    finally:
        stopped = stop_s3(handle)
        shutil.rmtree(home, ignore_errors=True)
    if not stopped:
        raise RuntimeError(f"SeaweedFS left processes behind: {handle.processes()}")
    return result


def bench(bucket: str, home: str, rows: int, args: argparse.Namespace, env: dict[str, str]) -> dict:
    from common import storage
    from common.config import ClusterConfig, DataConfig, TrainConfig

    local = os.path.join(home, "source.csv")
    t = time.perf_counter()
    size = generate_csv(local, rows, args.features)
    source = f"s3://{bucket}/bench/source.csv"
    storage.upload_file(local, source)
    os.unlink(local)
    print(f"generated and uploaded {size / 1e6:.0f} MB ({rows} rows × {args.features} float32) "
          f"in {time.perf_counter() - t:.0f} s", flush=True)

    copy_s = raw_copy(source, f"s3://{bucket}/bench/raw-copy.csv")
    print(f"raw copy S3 → S3: {copy_s:.1f} s, {size / 1e6 / copy_s:.1f} MB/s", flush=True)

    cfg = TrainConfig(data=DataConfig(source_uri=source, chunk_rows=args.chunk_rows),
                      cluster=ClusterConfig(num_workers=args.workers))
    work = os.path.join(home, "work")
    os.makedirs(work)
    prefix = f"s3://{bucket}/bench/shards"
    shard_out, shard_wall, shard_rss = run_child(CHILD_SHARD, cfg.to_json(), prefix, work, env=env, timeout=3600)
    shard_s = shard_out["seconds"]
    print(f"shard S3 → S3: {shard_s:.1f} s, {size / 1e6 / shard_s:.1f} MB/s, peak RSS {shard_rss:.0f} MB", flush=True)

    per_shard, _, _ = run_child(CHILD_VALIDATE, cfg.to_json(), prefix, env=env, timeout=3600)
    total_rows = sum(s["rows"] for s in per_shard)
    total_s = sum(s["seconds"] for s in per_shard)
    out_bytes = sum(s[2] for s in shard_out["shards"])
    result = {
        "rows": rows, "features": args.features, "source_mb": round(size / 1e6, 1),
        "shards_mb": round(out_bytes / 1e6, 1), "train_shards": args.workers, "chunk_rows": args.chunk_rows,
        "raw_copy_s": round(copy_s, 2), "raw_copy_mb_per_s": round(size / 1e6 / copy_s, 1),
        "shard_s": round(shard_s, 2), "shard_mb_per_s": round(size / 1e6 / shard_s, 1),
        "shard_rows_per_s": round(rows / shard_s), "ratio_to_raw_copy": round(copy_s / shard_s, 3),
        "shard_peak_rss_mb": round(shard_rss), "validate_rows_per_s": round(total_rows / total_s),
        "validate_per_shard": per_shard, "cpus": os.cpu_count(),
    }
    print("\n| measure | value |\n|---|---|")
    for key in ("source_mb", "shards_mb", "raw_copy_mb_per_s", "shard_mb_per_s", "ratio_to_raw_copy",
                "shard_rows_per_s", "shard_peak_rss_mb", "validate_rows_per_s"):
        print(f"| {key} | {result[key]} |")
    for s in per_shard:
        print(f"| validate {s['shard']} ({s['rows']} rows) | {s['rows_per_s']:.0f} rows/s |")
    return result


if __name__ == "__main__":
    main()
