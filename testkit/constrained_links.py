"""N1 and C2: the same 2-worker job on namespace hosts whose links are slowed with ``tc``.

Three hosts are network namespaces linked by veth pairs and a bridge
(``testkit/netns_hosts.py``, the ``hosts`` backend over ``ip netns exec``): scheduler
and server on host 0, a worker on each of hosts 1 and 2, so every push and pull crosses two
links. Every host's link is limited to the same rate in both directions (``tbf`` on its
``eth0`` and on its bridge port). The job: the ``debug`` recipe (digits, 2 workers, 1 server,
``dist_sync``, optimizer on the workers) with a wider MLP (``--hidden``, default 256×256: about
85 k parameters, 340 kB of gradients per worker per step), ``--epochs`` epochs; the shards are
in a folder every host sees (storage is not what is measured here).

- **N1, step time against bandwidth**: the job unconstrained and at each ``--rates`` (Mbit/s);
  the step time is the job's last-epoch ``step_time_s`` (rank 0). Beside it, what the planner's
  time model (``infra.perf_model.bandwidth_s``: full-duplex links, ps-lite's pipelining by key,
  frames, the links' ``tbf`` bucket) gives for the same arrays on links of that rate
  (``predicted_comm_s``), and the serial bound the planner's ``servers_for`` sizes with
  (``workers · 2 · params · 4 / (servers · rate)``, ``serial_comm_s``); the measured
  communication time is the step time minus the unconstrained one.
- **C2, 2-bit compression where the link is the bottleneck**: the job again at the lowest rate
  with ``gradient_compression: 2bit`` (threshold ``--threshold``): its wall time and step time ÷
  the plain job's at that rate, and the validation accuracy it costs (both jobs deterministic).

    .venv/bin/python benchmarks/constrained_links.py [--quick] [--rates 200,50,12.5] [--json OUT]

Needs root, ``ip netns`` and ``tc`` (iproute2); says why and exits 0 with ``skipped`` otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from typing import Any

from testkit.netns_hosts import (clear_link, link_stats, namespace_hosts, netns_available, shape_link,
                                 shaping_available, tbf_burst_bytes)
from testkit.server_load import mlp_keys
from testkit import chaos_jobs as cj
from testkit.digits import digits_csv
from testkit.result_file import write_json
from common import storage
from infra.perf_model import Link, bandwidth_s
from infra.planning import WIRE_BYTES

FEATURES, CLASSES = 64, 10  # the digits


def run_job(root: str, hosts: list[dict], cfg: Any, shards: str, name: str) -> dict[str, Any]:
    """One job on ``hosts`` as they are shaped now; its step time, accuracy and wall time."""
    from infra.cluster import ClusterSpec, provision

    out = os.path.join(root, name)
    job = cj.job_for(cfg, shards, out)
    spec = ClusterSpec(run_tag=f"bench-links-{uuid.uuid4().hex[:8]}", workers=2, servers=1, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=os.path.join(root, "home"))
    before = link_stats(hosts[0])
    started = time.monotonic()
    try:
        failed = cj.supervise(job, storage.join(out, "job.json"), cluster.job_cluster(), os.environ)
    finally:
        cluster.teardown()
    wall = time.monotonic() - started
    if failed is not None:
        raise RuntimeError(f"the {name} job failed: {failed}")
    after = link_stats(hosts[0])
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    last = metrics["history"][-1]
    params = sum(a.size for a in cj.final_params(job)[1].values())
    steps = int(metrics["global_step"])
    return {"name": name, "wall_s": wall, "step_time_s": last["step_time_s"], "val_accuracy": last["val_accuracy"],
            "steps": steps, "params": params,
            "server_host_rx_bytes_per_step": (after["rx_bytes"] - before["rx_bytes"]) / max(steps, 1),
            "server_host_tx_bytes_per_step": (after["tx_bytes"] - before["tx_bytes"]) / max(steps, 1)}


def serial_comm_s(params: int, workers: int, servers: int, rate_mbit: float) -> float:
    """The serial bound ``servers_for`` sizes with: pushes then pulls down one wire."""
    return workers * 2 * params * WIRE_BYTES / (servers * rate_mbit * 1e6 / 8)


def predicted_comm_s(hidden: list[int], workers: int, servers: int, rate_mbit: float) -> float:
    """The planner's time model for one step's bytes of the job's MLP on links shaped as
    ``shape_link`` shapes them (its ``tbf`` bucket included)."""
    sizes = [size for _, size in mlp_keys(FEATURES, hidden, CLASSES)]
    link = Link(rate_mbit * 1e6 / 8, burst_bytes=tbf_burst_bytes(rate_mbit))
    return bandwidth_s(sizes, workers, servers, link)


def shape_all(hosts: list[dict], rate_mbit: float | None) -> None:
    for host in hosts:
        if rate_mbit:
            shape_link(host, rate_mbit=rate_mbit)
        else:
            clear_link(host)


def measure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from testkit.chaos import base_config
    from data_checks.shard import shard_dataset

    cfg = base_config().replace(model={"hidden": tuple(args.hidden)}, optim={"epochs": args.epochs},
                                cluster={"stall_timeout_s": 300.0})
    data = os.path.join(root, "data")
    os.makedirs(data)
    with open(os.path.join(data, "digits.csv"), "wb") as fh:
        fh.write(digits_csv(1))
    cfg = cfg.replace(data={"source_uri": os.path.join(data, "digits.csv")})
    shards = os.path.join(data, "shards")
    shard_dataset(cfg, shards)
    rates = [float(r) for r in args.rates.split(",")]
    sweep: list[dict[str, Any]] = []
    with namespace_hosts(3, prefix=f"mxcl{os.getpid() % 10000}") as hosts:
        base = run_job(root, hosts, cfg, shards, "unconstrained")
        print(f"unconstrained: step {base['step_time_s'] * 1000:.1f} ms, {base['params']} parameters", flush=True)
        for rate in rates:
            shape_all(hosts, rate)
            row = run_job(root, hosts, cfg, shards, f"rate-{rate:g}")
            predicted = predicted_comm_s(args.hidden, 2, 1, rate)
            measured = row["step_time_s"] - base["step_time_s"]
            row.update(rate_mbit=rate, predicted_comm_s=predicted, measured_comm_s=measured,
                       measured_over_predicted=measured / predicted,
                       serial_comm_s=serial_comm_s(row["params"], 2, 1, rate))
            sweep.append(row)
            print(f"{rate:g} Mbit/s: step {row['step_time_s'] * 1000:.0f} ms, comm {measured * 1000:.0f} ms measured "
                  f"vs {predicted * 1000:.0f} ms planned (×{measured / predicted:.2f})", flush=True)
        slowest = min(rates)
        shape_all(hosts, slowest)
        comp_cfg = cfg.replace(cluster={"gradient_compression": "2bit", "compression_threshold": args.threshold})
        comp = run_job(root, hosts, comp_cfg, shards, f"2bit-rate-{slowest:g}")
        shape_all(hosts, None)
    plain = next(r for r in sweep if r["rate_mbit"] == slowest)
    compression = {"rate_mbit": slowest, "threshold": args.threshold, "plain": plain, "compressed": comp,
                   "wall_ratio": comp["wall_s"] / plain["wall_s"],
                   "step_time_ratio": comp["step_time_s"] / plain["step_time_s"],
                   "accuracy_cost_points": 100 * (plain["val_accuracy"] - comp["val_accuracy"])}
    print(f"2-bit at {slowest:g} Mbit/s: wall ×{compression['wall_ratio']:.2f}, step ×{compression['step_time_ratio']:.2f}, "
          f"accuracy {comp['val_accuracy']:.4f} vs {plain['val_accuracy']:.4f}", flush=True)
    return {"unconstrained": base, "sweep": sweep, "compression": compression, "epochs": args.epochs,
            "hidden": list(args.hidden), "workers": 2, "servers": 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 epochs per job (the default is 4)")
    ap.add_argument("--rates", default="200,50,12.5", help="link rates in Mbit/s, comma-separated (at least 3)")
    ap.add_argument("--epochs", type=int, default=0)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    args.epochs = args.epochs or (2 if args.quick else 4)
    why = netns_available() or shaping_available()
    if why:
        print(f"skipped: {why}")
        write_json(args.json, {"skipped": why})
        return 0
    with tempfile.TemporaryDirectory(prefix="mxpipe-links-") as root:
        result = measure(args, root)
    write_json(args.json, result)
    return 0

