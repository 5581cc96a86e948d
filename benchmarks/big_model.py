"""A big model over 4 servers: checkpoint save and restore time, the loop's blocked share (P2),
each server's share of the parameters and of the traffic, and the planner's figures beside them.

    .venv/bin/python benchmarks/big_model.py --hidden 3000,3000 --epochs 2          # ~9.2 M params
    .venv/bin/python benchmarks/big_model.py --hidden 10000,10000 --epochs 2 \\
        --json big.json --plot big.png                                              # ~100.7 M params

A real local job through the project's interfaces (``testkit.local_jobs.run_local``: a JobSpec
under a detached supervisor on the local backend): the ``debug`` recipe's MLP on sklearn's digits
(64 features, 10 classes) with ``model.hidden`` as given (10000,10000: 64·10⁴ + 10⁸ + 10⁵ weights,
100.75 M parameters, 403 MB fp32), ``--workers`` workers, ``--servers`` servers, ``dist_sync`` with
the optimizer on the workers (SGD, momentum 0.9: a checkpoint holds params + momentum, 806 MB),
checkpoints every ``--every`` steps to a SeaweedFS S3 started here (``infra.s3_service.start_s3``,
as ``benchmarks/checkpoint_overhead.py``). Worker 1 kills itself (SIGKILL) once at ``--kill-step``
(``MXPIPE_FAULT_KILL_STEP`` / ``_RANK`` / ``_ONCE_FILE``): the supervisor restarts the roles in
place and they resume from the newest checkpoint.

Every timing comes from the supervisor's typed event log (``MXPIPE_EVENTS_FILE``, read with
``testkit.timeline``; never the human log text):

- save: each ``checkpoint_committed`` event's ``upload_s`` (serialise, hash, put, commit; in the
  background) and ``bytes``;
- restore: the failure timeline's ``restore`` term (worker-0 met in ps-lite → the ``resumed``
  event: shards fetched, model built, checkpoint read, verified and loaded), and the whole
  recovery (kill → first step after the resume);
- P2, the share of the loop blocked by checkpointing: the sum of the commits' ``blocked_s`` (the
  snapshot, any wait for the upload in flight) over the loop's wall time, per attempt from
  worker-0's first step mark to its last step mark or rank 0's last commit (as ``checkpoint_overhead.py``
  defines it: steady state; the one-off wait for the last upload at the job's end is not an event
  and is left out, as there).

The machine's run queue (``testkit.run_queue``: runnable threads, others' work included) is
sampled throughout and its mean recorded for each save, the restore and the loop: the planner's
fair share of the 2 cores takes it.

Servers (``testkit.server_load``): the predicted share of the parameters from MXNet 1.9's key
assignment (``MXNET_KVSTORE_BIGARRAY_BOUND``, ``--bound`` to change it), beside each server's
measured TCP bytes received and sent (``ss``: psutil's I/O counters do not count socket I/O) and
its RSS growth from worker-0's join on. The prediction is per ps-lite server rank and the
measurement per role (ps-lite ranks servers in the order they register), so they are compared,
and plotted, largest first. The planner's time model (``infra.perf_model``: communication, save,
restore) is put beside these figures by ``benchmarks/predicted.py``. Planner (``infra.planning``): what it
does say for this model is the server count (``servers_for``: a step's ``workers · 2 · P · 4``
bytes within ``COMM_BUDGET_S`` on the instance's link), an even share per server
(``step_bytes / servers``), and so a communication time ``workers · 2 · P · 4 / (servers ·
link)``; that time is given here on the loopback rate measured on this machine (one 200 MB
transfer), beside the measured communication: the job's step time minus the same MLP's compute
step timed in this process without a kvstore (``--compute-only`` prints that alone).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import storage  # noqa: E402
from common.events import CheckpointCommitted, WorkerStarted  # noqa: E402
from testkit.dag_stack import read_events  # noqa: E402
from testkit.digits import digits_csv  # noqa: E402
from testkit.local_jobs import make_job, run_local  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.run_queue import RunQueueSampler  # noqa: E402
from testkit.server_load import (DEFAULT_BIGARRAY_BOUND, ServerSampler, imbalance, mlp_keys,  # noqa: E402
                                 ranked, server_elements, shares)
from testkit.timeline import LEAD, attempts, failure_timeline, first_event, role_event, role_event_of  # noqa: E402

FEATURES, CLASSES = 64, 10


def loopback_rate_bps(nbytes: int = 200_000_000) -> float:
    """Bytes per second of one TCP transfer over loopback on this machine (the planner's link here)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    done = threading.Event()

    def sink() -> None:
        conn, _ = srv.accept()
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 20))
        conn.close()
        done.set()

    threading.Thread(target=sink, daemon=True).start()
    buf = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started, sent = time.monotonic(), 0
        while sent < nbytes:
            sent += conn.send(buf[: min(len(buf), nbytes - sent)])
        if not done.wait(120):
            raise RuntimeError("loopback transfer did not finish in 120 s")
        elapsed = time.monotonic() - started
    srv.close()
    return nbytes / elapsed


def compute_step_s(hidden: tuple[int, ...], batch: int, steps: int = 5) -> float:
    """Seconds per step of the same MLP in this process with no kvstore (forward, backward, SGD
    update, one thread as a role has): the step's compute, so that the job's step time minus it
    is the communication the planner's figure stands beside."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")
    from common.mx import import_mxnet

    mx = import_mxnet()
    net = mx.gluon.nn.HybridSequential()
    for width in hidden:
        net.add(mx.gluon.nn.Dense(width, activation="relu"))
    net.add(mx.gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=None)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.random.uniform(shape=(batch, FEATURES))
    y = mx.nd.array([i % CLASSES for i in range(batch)])
    times = []
    for _ in range(steps + 1):  # the first builds the graph
        t0 = time.monotonic()
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch)
        loss.mean().asscalar()
        times.append(time.monotonic() - t0)
    return statistics.median(times[1:])


def blocked_share(events: list[dict[str, Any]]) -> dict[str, Any]:
    """P2 from the commit events (module docstring), over every attempt."""
    loop_s = blocked = 0.0
    saves = []
    for a in attempts(events):
        if not a.points:
            continue
        start = a.points[0][0]
        end = a.points[-1][0]
        for ev in events:
            # Any worker's: only kvstore rank 0 writes, and ps-lite may give rank 0 to worker-1.
            if a.start <= ev["t"] <= a.end and str(ev.get("role", "")).startswith("worker-"):
                got = role_event_of(ev)
                if isinstance(got, CheckpointCommitted) and ev["t"] >= start:
                    end = max(end, ev["t"])
                    saves.append({"t": ev["t"], "step": got.step, "bytes": got.bytes, "upload_s": got.upload_s,
                                  "blocked_s": got.blocked_s})
                    blocked += got.blocked_s or 0.0
        loop_s += end - start
    return {"loop_s": loop_s, "blocked_s": blocked, "blocked_fraction": blocked / loop_s if loop_s else None,
            "saves": saves}


def ranked_shares(result: dict[str, Any]) -> dict[str, list[float]]:
    """Each series' shares largest first: the prediction is per ps-lite server rank, the
    measurement per role, and the two are not the same numbering (``testkit.server_load``)."""
    servers = result["servers"]
    predicted = result.get("predicted_params_by_rank") or [s["predicted_params"] for s in servers]  # older files
    return {"params (MXNet rule)": ranked(shares(predicted)),
            "received (ss)": ranked(shares([s["received_bytes"] for s in servers])),
            "sent (ss)": ranked(shares([s["sent_bytes"] for s in servers]))}


def plot(path: str, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = ranked_shares(result)
    n = len(result["servers"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(n)], values, width, label=label)
    mean = 1 / n
    ax.axhline(mean, color="grey", lw=1, ls=":", label="mean")
    ax.axhline(1.5 * mean, color="red", lw=1, ls="--", label="goal: ≤ 1.5 × mean")
    ax.set_xticks([x + width for x in range(n)], [f"server #{i + 1}" for i in range(n)])
    ax.set_xlabel("servers, largest share first")
    ax.set_ylabel("share")
    ax.set_title(f"{result['params'] / 1e6:.1f} M parameters over {n} servers, {result['workers']} workers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="3000,3000", help="model.hidden (10000,10000 for ~100 M parameters)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every_n_steps")
    ap.add_argument("--kill-step", type=int, default=25, help="worker 1 is killed once after this global step")
    ap.add_argument("--bound", type=int, default=0, help="MXNET_KVSTORE_BIGARRAY_BOUND for the roles (0: MXNet's)")
    ap.add_argument("--timeout-s", type=float, default=3000.0)
    # The loop runs ahead of MXNet's engine between loss read-backs (training.loop.step), so a
    # worker can be silent for several steps; at ~30 s a step (100 M parameters on 2 shared
    # cores) that outlasted the default 120 s and the supervisor restarted a healthy job.
    ap.add_argument("--stall-timeout-s", type=float, default=1800.0, help="cluster.stall_timeout_s")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--plot", help="write the per-server share plot (PNG) to this file")
    ap.add_argument("--replot", help="only redraw --plot from this result file")
    ap.add_argument("--compute-only", action="store_true", help="only time the model's compute per step")
    args = ap.parse_args()
    hidden = tuple(int(h) for h in args.hidden.split(","))
    if args.compute_only:
        print(json.dumps({"compute_step_s": compute_step_s(hidden, args.batch_size), "load_avg": os.getloadavg()}))
        return 0
    if args.replot:
        with open(args.replot) as fh:
            plot(args.plot, json.load(fh))
        return 0

    from common.config import recipe
    from data_checks.shard import shard_dataset
    from infra.planning import COMM_BUDGET_S, WIRE_BYTES, servers_for
    from infra.s3_service import start_s3, stop_s3
    from infra.stack_config import StackConfig, stack_env

    keys = mlp_keys(FEATURES, hidden, CLASSES)
    params = sum(size for _, size in keys)
    bound = args.bound or DEFAULT_BIGARRAY_BOUND
    predicted = server_elements([size for _, size in keys], args.servers, bound)
    rate = loopback_rate_bps()
    compute_s = compute_step_s(hidden, args.batch_size)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mxpipe-bigmodel-") as tmp:
        cfg_stack = StackConfig.with_free_ports(tmp)
        cfg_stack.save()
        handle = start_s3(cfg_stack)
        try:
            for k, v in stack_env(cfg_stack.home).items():
                if k.startswith("AWS_"):
                    os.environ[k] = v
            os.environ.pop("AWS_ENDPOINT_URL", None)
            prefix = f"s3://{cfg_stack.bucket}/bigmodel-{int(time.time())}"
            source = storage.join(prefix, "digits.csv")
            storage.put_bytes(source, digits_csv())
            cfg = recipe("debug", source).replace(
                model={"hidden": hidden},
                optim={"epochs": args.epochs, "optimizer": "sgd", "learning_rate": 0.01, "momentum": 0.9,
                       "batch_size": args.batch_size},
                cluster={"num_workers": args.workers, "num_servers": args.servers, "kvstore": "dist_sync",
                         "optimizer_on": "workers", "job_timeout_s": args.timeout_s,
                         "stall_timeout_s": args.stall_timeout_s},
                checkpoint={"every_n_steps": args.every, "keep": 2})
            shards = storage.join(prefix, "shards")
            shard_dataset(cfg, shards)
            job = make_job(cfg, shards, prefix)
            events_file, once = Path(tmp) / "events.jsonl", Path(tmp) / "fault-fired"
            env = {"MXPIPE_EVENTS_FILE": str(events_file), "MXPIPE_FAULT_KILL_STEP": str(args.kill_step),
                   "MXPIPE_FAULT_KILL_RANK": "1", "MXPIPE_FAULT_ONCE_FILE": str(once)}
            if args.bound:
                env["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(args.bound)
            home = os.path.join(tmp, "home")
            started = time.monotonic()
            with ServerSampler(home) as sampler, RunQueueSampler() as run_queue:
                run_local(job, storage.join(prefix, "job.json"), home, env, timeout_s=args.timeout_s)
            wall = time.monotonic() - started
            metrics = json.loads(storage.get_bytes(job.metrics_uri))
        finally:
            stop_s3(handle)
        events = read_events(events_file)
        if not once.exists():
            raise RuntimeError("the fault did not fire: no restore to measure (is --kill-step within the run?)")
        kill_t = once.stat().st_mtime
        recovery = failure_timeline(events, kill_t)
    load_after = os.getloadavg()
    # The threads that wanted the 2 cores during each phase (the planner's fair share takes it):
    # each save's upload, the restore (worker-0 joined → resumed), and the main attempt's loop.
    resumed_t = kill_t + sum(recovery[k] for k in ("detect", "teardown", "retry", "cluster_start", "restore"))
    restore_runnable = run_queue.mean(resumed_t - recovery["restore"], resumed_t)

    p2 = blocked_share(events)
    saves = p2.pop("saves")
    for save in saves:
        save["runnable"] = run_queue.mean(save["t"] - save["upload_s"], save["t"])
    runs = attempts(events)
    step_s = statistics.median([r for a in runs if (r := a.seconds_per_step()) is not None])
    # Per attempt: a restart in place starts new servers, which ps-lite ranks anew (in one
    # 100 M run the role holding rank 0's keys changed between attempts), so shares are taken
    # over one attempt's servers: the one that moved the most bytes.
    names = [f"server-{i}" for i in range(args.servers)]
    per_attempt = []
    for att in sampler.attempts():
        rx = [att[n].received if n in att else 0 for n in names]
        tx = [att[n].sent if n in att else 0 for n in names]
        per_attempt.append({"received_bytes": rx, "sent_bytes": tx, "received_imbalance": imbalance(rx),
                            "sent_imbalance": imbalance(tx), "ranked_received_share": ranked(shares(rx)),
                            "ranked_sent_share": ranked(shares(tx))})
    main_i = max(range(len(per_attempt)), key=lambda i: sum(per_attempt[i]["received_bytes"]))
    att = sampler.attempts()[main_i]
    servers = []
    for n in names:
        ld = att.get(n)
        # Memory from the moment worker-0 joined ps-lite in that attempt (the servers have
        # imported mxnet by then: their rendezvous runs inside that import): keys and buffers.
        joined = first_event(events, role_event(WorkerStarted, LEAD), ld.rss[0][0])["t"] if ld and ld.rss else None
        servers.append({"server": n, "received_bytes": ld.received if ld else 0, "sent_bytes": ld.sent if ld else 0,
                        "rss_at_join_mb": ld.rss_before(joined) / 1e6 if joined else None,
                        "rss_peak_mb": ld.rss_peak / 1e6 if ld else None,
                        "rss_growth_mb": (ld.rss_peak - ld.rss_before(joined)) / 1e6 if joined else None})
    received = [x["received_bytes"] for x in servers]
    sent = [x["sent_bytes"] for x in servers]
    steps = int(metrics["global_step"])
    # Steps the main attempt's servers served (the sampler's attempts and the timeline's are
    # the same rounds in the same order).
    executed = (runs[main_i].points[-1][1] - runs[main_i].resumed_from
                if len(runs) == len(per_attempt) and runs[main_i].points else None)
    planner_servers = servers_for(params, args.workers, rate * 8 / 1e9)
    planned_comm_s = args.workers * 2 * params * WIRE_BYTES / (args.servers * rate)
    result = {
        "params": params, "model_mb": params * 4 / 1e6, "hidden": list(hidden), "workers": args.workers,
        "servers_used": args.servers, "bigarray_bound": bound, "steps": steps, "job_wall_s": wall,
        "load_avg_before": load_before, "load_avg_after": load_after, "cpus": os.cpu_count(),
        "seconds_per_step": step_s,
        "checkpoint": {
            "committed": len(saves), "bytes": statistics.median([s["bytes"] for s in saves]) if saves else None,
            "save_upload_s_median": statistics.median([s["upload_s"] for s in saves]) if saves else None,
            "save_upload_s_max": max(s["upload_s"] for s in saves) if saves else None,
            "blocked_s_per_save_median": statistics.median([s["blocked_s"] for s in saves]) if saves else None,
            "runnable_median": statistics.median([s["runnable"] for s in saves if s["runnable"] is not None])
            if any(s["runnable"] is not None for s in saves) else None,
            **p2, "p2_goal": 0.01, "saves": saves,
            "planner": "infra.perf_model.save_s / restore_s, beside these figures in benchmarks/predicted.py"},
        "restore": {**{k: recovery[k] for k in ("detect", "teardown", "retry", "cluster_start", "restore",
                                                "first_step", "total", "resumed_from_step")},
                    "runnable": restore_runnable},
        "loop_runnable": run_queue.mean(runs[main_i].points[0][0], runs[main_i].points[-1][0])
        if len(runs) > main_i and runs[main_i].points else None,
        "servers": servers,  # per role, in the attempt that moved the most bytes
        "traffic_attempt": main_i, "attempts_traffic": per_attempt,
        "predicted_params_by_rank": predicted,  # per ps-lite server rank
        "param_imbalance_predicted": imbalance(predicted), "received_imbalance": imbalance(received),
        "sent_imbalance": imbalance(sent), "imbalance_goal": 1.5,
        "planner": {"loopback_bytes_per_s": rate, "servers_for": planner_servers, "comm_budget_s": COMM_BUDGET_S,
                    "share_per_server": 1 / args.servers,
                    "step_bytes_per_server": args.workers * 2 * params * WIRE_BYTES / args.servers,
                    "measured_bytes_per_server_per_step": [(rx + tx) / executed for rx, tx in zip(received, sent)]
                    if executed else None,
                    "steps_executed": executed,
                    "comm_s_per_step": planned_comm_s, "measured_step_s": step_s,
                    "compute_step_s": compute_s, "measured_comm_s_per_step": step_s - compute_s,
                    "measured_over_planned_comm": (step_s - compute_s) / planned_comm_s},
        "sampler_errors": sampler.errors,
    }
    result["ranked_shares"] = ranked_shares(result)  # compared largest first
    print(json.dumps({k: v for k, v in result.items() if k != "checkpoint"} | {"checkpoint": {
        k: v for k, v in result["checkpoint"].items() if k != "saves"}}, indent=2))
    write_json(args.json, result)
    if args.plot:
        plot(args.plot, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
