"""Chaos R4: a network fault on the multi-host (``hosts``) backend, over network namespaces.

Three hosts are network namespaces of this machine linked by veth pairs and a bridge in a
namespace of its own (``testkit/netns_hosts.py``): scheduler and server on host 0, one
worker on each of hosts 1 and 2, so ps-lite traffic crosses the veth links. Mid-run (after the
first committed checkpoint) worker-1's host link is cut (``ip -n HOST link set eth0 down``) and
restored ``cut_s`` later, once shorter and once longer than the job's stall timeout.

What is and is not cut: the roles reach each other only through the bridge, so the cut host
sends and receives nothing; the supervisor reaches its roles through ``ip netns exec`` (a local
process per role, no network), so unlike over ssh its control channel survives the cut and the
stall detector is what notices. No traffic leaves the namespaces; no address is added outside.

Storage is a local folder every namespace sees (the S3 fixture binds 127.0.0.1, which a
namespace cannot reach), as an NFS/EFS mount would be on real hosts.

Needs root and ``ip netns``; ``why_not()`` says why R4 cannot run here.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from testkit.netns_hosts import hosts_pids, namespace_hosts, netns_available
from testkit import chaos_jobs as cj
from testkit.digits import digits_csv
from common import storage
from common.procs import Watch
from common.config import TrainConfig

STALL_S = 20.0  # the job's stall timeout in R4: short enough to keep the long cut brief
CUT_WAIT_S = 300.0  # bound on waiting for the first checkpoint before the cut
VICTIM_HOST = 2  # worker-1's host


def why_not() -> str:
    """Empty when R4 can run on this machine, else the reason (root, ``ip netns``)."""
    return netns_available()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _cut_link(ns: str, events: Path, cut_s: float, marks: dict[str, float], errors: list[BaseException]) -> None:
    """Wait for the first committed checkpoint, then take ``ns``'s eth0 down for ``cut_s``."""
    try:
        deadline = time.monotonic() + CUT_WAIT_S
        while "checkpoint committed: step" not in (events.read_text() if events.exists() else ""):
            if time.monotonic() > deadline:
                raise TimeoutError("R4: no checkpoint committed before the cut was due")
            time.sleep(0.2)
        marks["down"] = time.time()
        _ip("-n", ns, "link", "set", "eth0", "down")
        time.sleep(cut_s)
    except BaseException as exc:  # noqa: BLE001 - reported by the caller
        errors.append(exc)
    finally:
        if "down" in marks:  # never leave the link down, whatever happened
            _ip("-n", ns, "link", "set", "eth0", "up")
            marks["up"] = time.time()


def _attempt(job: Any, job_uri: str, cluster: Any, events: Path) -> tuple[str | None, float]:
    """One attempt, its supervisor detached on the cluster's first host: (failure, seconds)."""
    started = time.monotonic()
    failed = cj.supervise(job, job_uri, cluster.job_cluster(), {**os.environ, "MXPIPE_EVENTS_FILE": str(events)})
    return failed, time.monotonic() - started


def _left(cluster: Any, hosts: list[dict]) -> list[int]:
    """Role processes of the cluster still alive, on this machine or in any namespace host."""
    watch = Watch(tags=[("MXPIPE_CLUSTER", cluster.cluster_id)], probes=[lambda: hosts_pids(hosts)])
    return watch.left(cj.ORPHAN_WAIT_S)


def trial(root: Path, hosts: list[dict], cfg: TrainConfig, shards: str, cut_s: float) -> Any:
    """One cut of ``cut_s`` seconds; a retry over the same run folder if the job was torn down."""
    from testkit.chaos import Trial
    from infra.cluster import ClusterSpec, provision

    name = f"r4-cut{cut_s:g}"
    out = str(root / name)
    job = cj.job_for(cfg, shards, out)
    job_uri = storage.join(out, "job.json")
    spec = ClusterSpec(run_tag=f"chaos-r4-{uuid.uuid4().hex[:8]}", workers=2, servers=1, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=str(root / "home"))
    marks: dict[str, float] = {}
    errors: list[BaseException] = []
    first_events, retry_events = root / f"{name}-0.jsonl", root / f"{name}-1.jsonl"
    cutter = threading.Thread(target=_cut_link, args=(hosts[VICTIM_HOST]["netns"], first_events, cut_s, marks,
                                                      errors), daemon=True)
    try:
        cutter.start()
        failed, seconds = _attempt(job, job_uri, cluster, first_events)
        cutter.join(timeout=CUT_WAIT_S + cut_s + 30)
        orphans_first = _left(cluster, hosts)
        retry_failed, retry_s = (None, 0.0)
        if failed is not None:  # as the Airflow retry: a fresh job over the same run folder
            retry_failed, retry_s = _attempt(job, job_uri, cluster, retry_events)
    finally:
        cluster.teardown()
    orphans = orphans_first + _left(cluster, hosts)
    first = cj.Attempt(failed, _read_events(first_events), [], None, seconds)
    retry = cj.Attempt(retry_failed, _read_events(retry_events), [], None, retry_s)
    return _judge(Trial, name, job, cfg, cut_s, marks, errors, first, retry, orphans)


def _read_events(path: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def _judge(trial_cls: Any, name: str, job: Any, cfg: TrainConfig, cut_s: float, marks: dict[str, float],
           errors: list[BaseException], first: Any, retry: Any, orphans: list[int]) -> Any:
    down, up = marks.get("down"), marks.get("up")
    finished = (first.failed is None) or (retry.failed is None and bool(retry.events))
    step = cj.final_params(job)[0] if finished else None
    torn = first.failed is not None
    checks: dict[str, bool] = {"link cut mid-run": not errors and down is not None and up is not None,
                               "no orphan process": not orphans, "run finished": finished,
                               "finished at the last step": step is not None and step == cj.final_step(job)}
    if cut_s < cfg.cluster.stall_timeout_s:
        checks["job rode out the cut (no teardown)"] = not torn
        after = [e["t"] for e in first.events if e["event"] == "line" and up is not None and e["t"] > up]
        recovery = (min(after) - up) if after else None
        outcome = "recovered" if not torn else f"torn down: {(first.failed or '').splitlines()[0]}"
    else:
        failed_at = next((e["t"] for e in first.events if e["event"] == "role_failed"), None)
        stopped_at = next((e["t"] for e in first.events if e["event"] == "roles_stopped"), None)
        checks["torn down by the stall detector"] = torn and "stalled" in (first.failed or "")
        checks["torn down within stall timeout + 15 s of the cut"] = (
            failed_at is not None and down is not None and failed_at - down <= cfg.cluster.stall_timeout_s + 15)
        checks["retry resumed from a checkpoint"] = bool(retry.resumed_step())
        done = retry.first_time("first step after resume done")
        recovery = (done - down) if done is not None and down is not None else None
        outcome = (f"torn down after {failed_at - down:.1f}s: {(first.failed or '').splitlines()[0]}; "
                   f"teardown {stopped_at - failed_at:.1f}s; retry resumed from step {retry.resumed_step()}"
                   if torn and failed_at and stopped_at and down else
                   "recovered (no teardown)" if not torn else f"torn down: {(first.failed or '')[:200]}")
    t = trial_cls("R4", f"link of worker-1's host down {cut_s:g}s (stall timeout {cfg.cluster.stall_timeout_s:g}s)",
                  checks, recovery_s=recovery)
    t.details.update({"outcome": outcome, "cut": marks, "errors": [repr(e) for e in errors],
                      "first_error": (first.failed or "")[-1500:] or None,
                      "retry_error": (retry.failed or "")[-1500:] or None, "orphans": orphans,
                      "attempt_s": [round(first.seconds, 2), round(retry.seconds, 2)],
                      "resumed_step": retry.resumed_step(), "final_step": step})
    return t


def r4(root: Path, cut_seconds: list[float], copies: int = 6) -> list[Any]:
    """Both cuts on one set of namespace hosts; the data is ``copies`` jittered digits copies, so
    the job is still training when the cut ends."""
    from testkit.chaos import base_config
    from data_checks.shard import shard_dataset

    root.mkdir(parents=True, exist_ok=True)
    cfg = base_config().replace(optim={"epochs": 1}, cluster={"stall_timeout_s": STALL_S})
    data = root / "data"
    data.mkdir(exist_ok=True)
    (data / "digits.csv").write_bytes(digits_csv(copies))
    cfg = cfg.replace(data={"source_uri": str(data / "digits.csv")})
    shard_dataset(cfg, str(data / "shards"))
    out = []
    with namespace_hosts(3, prefix=f"mxr4{os.getpid() % 10000}") as hosts:
        for cut_s in cut_seconds:
            out.append(trial(root, hosts, cfg, str(data / "shards"), cut_s))
    return out
