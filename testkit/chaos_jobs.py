"""Job-level parts of the chaos harness (``benchmarks/chaos.py``): an S3 server of its own that can
be stopped and restarted on the same ports and data folder, one job attempt with a role killed
at an exact training step, and the facts every trial is checked against.

An attempt is a real local-backend ``dist_sync`` job (scheduler, servers, workers as process
groups) started exactly as the ``train`` task starts it: ``python -m training supervise``
detached on the cluster, waited on through its status record (``training.launch.detached``); a
retry is a second attempt over the same run prefix, as the Airflow retry is. Every role of an attempt
carries ``MXPIPE_CHAOS_TAG=<unique>`` in its environment, so the orphan check scans every
process on the machine (``common.procs.Watch``) rather than trusting the supervisor's own list.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common import storage
from common.procs import Watch
from common.procs.records import load_records
from training.checkpoint.store import CheckpointStore, store_for
from common.config import TrainConfig
from training.launch.detached import local_cluster, run_detached
from training.launch.job import JobSpec
from training.launch.launcher import JobFailed

TAG = "MXPIPE_CHAOS_TAG"
ORPHAN_WAIT_S = 10.0
# One attempt's bound; the supervisor's own stall detection ends a hung job long before.
ATTEMPT_TIMEOUT_S = 1800.0


# -- the S3 server ------------------------------------------------------------------------------


class ChaosStack:
    """A SeaweedFS S3 server on free ports under ``root`` (credentials enforced), on 127.0.0.1 or
    on ``address`` (a bridge address namespace hosts reach)."""

    def __init__(self, root: Path, address: str | None = None) -> None:
        from infra.stack_config import StackConfig, load_credentials

        self.cfg = StackConfig.with_free_ports(root / "stack", **({"s3_host": address} if address else {}))
        self.cfg.save()
        self.creds = load_credentials(self.cfg.home)
        self.handle: Any = None

    @property
    def bucket(self) -> str:
        return self.cfg.bucket

    def start(self, timeout_s: float = 180.0) -> float:
        """Start (or restart: same ports, same data folder); returns the seconds it took."""
        from infra.s3_service import start_s3

        started = time.monotonic()
        self.handle = start_s3(self.cfg, timeout_s=timeout_s)
        return time.monotonic() - started

    def stop(self) -> None:
        from infra.s3_service import stop_s3

        if self.handle is not None and not stop_s3(self.handle):
            raise RuntimeError(f"SeaweedFS left processes behind: {self.handle.processes()}")
        self.handle = None

    def client_env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_S3": self.cfg.s3_endpoint, "AWS_ACCESS_KEY_ID": self.creds["access_key"],
                "AWS_SECRET_ACCESS_KEY": self.creds["secret_key"], "AWS_DEFAULT_REGION": "us-east-1"}

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """This process's S3 calls (and every role's, which inherit it) go to this server."""
        saved = {k: os.environ.get(k) for k in (*self.client_env(), "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN",
                                                 "AWS_PROFILE")}
        os.environ.update(self.client_env())
        for key in ("AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            os.environ.pop(key, None)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


# -- one attempt --------------------------------------------------------------------------------


def job_for(cfg: TrainConfig, shards_prefix: str, prefix: str) -> JobSpec:
    """The job a run prefix stands for; the same document on every attempt."""
    return JobSpec(config=cfg, shards_prefix=shards_prefix, checkpoint_prefix=storage.join(prefix, "checkpoints"),
                   model_prefix=storage.join(prefix, "model"), metrics_uri=storage.join(prefix, "metrics.json"),
                   run_name=prefix.rsplit("/", 1)[-1])


@dataclass
class Attempt:
    """What one job attempt did, from the supervisor's event log (``MXPIPE_EVENTS_FILE``)."""

    failed: str | None  # the supervisor's JobFailed message, None if the job finished
    events: list[dict[str, Any]]
    orphans: list[int]  # pids of this attempt's roles still alive after the supervisor returned
    fault_at: float | None  # wall time the injected fault fired (its once-file), if it did
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def lines(self, needle: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "line" and needle in e["text"]]

    def first_time(self, needle: str, after: float = 0.0) -> float | None:
        return next((e["t"] for e in self.lines(needle) if e["t"] >= after), None)

    def resumed_step(self) -> int | None:
        """The step the workers restored (None: started fresh)."""
        for e in self.lines("resumed from step "):
            return int(e["text"].split("resumed from step ")[1].split()[0])
        for e in self.lines("resumed at the final step "):
            return int(e["text"].split("resumed at the final step ")[1].split(":")[0])
        return None


def supervise(job: JobSpec, job_uri: str, cluster: dict[str, Any], env: Mapping[str, str]) -> str | None:
    """Run ``job`` as the train task does: its document at ``job_uri`` (status record beside it)
    naming ``cluster`` (a job document's cluster section), its supervisor detached there with
    ``env``. The failure's message, None if the job finished."""
    job = dataclasses.replace(job, status_uri=storage.join(job_uri.rsplit("/", 1)[0], "job_status.json"),
                              cluster=cluster)
    job.save(job_uri)
    try:
        run_detached(job_uri, env=env, timeout_s=ATTEMPT_TIMEOUT_S)
    except JobFailed as exc:
        return str(exc)
    return None


def _write_victim_pid(procs: Path, victim: str, pid_file: Path, done: threading.Event) -> None:
    """Write the pid of role ``victim`` to ``pid_file`` as soon as the cluster records it (under
    ``procs``, one folder per attempt): the ``MXPIPE_FAULT_KILL_PID_FILE`` a worker reads when
    its kill step comes, not before."""
    while not done.wait(0.05):
        for folder in sorted(procs.glob("*")) if procs.is_dir() else []:
            for rec in load_records(str(folder)):
                if rec.name == victim:
                    tmp = pid_file.with_suffix(".tmp")
                    tmp.write_text(str(rec.pid))
                    os.replace(tmp, pid_file)  # never a half-written pid for the worker to read
                    return


def run_attempt(job: JobSpec, workdir: Path, *, victim: str | None = None, kill_step: int = 0,
                killer_rank: int = 0, env: Mapping[str, str] | None = None, cluster: Any = None) -> Attempt:
    """Run the job once. With ``victim`` (a role name: ``worker-1``, ``server-0``, ``scheduler``)
    worker ``killer_rank`` SIGKILLs that role right after global step ``kill_step``, once per
    ``workdir`` (a retry in the same workdir runs clean, as an Airflow retry would). With
    ``cluster`` (an ``infra.cluster`` backend, no ``victim``) the roles run there instead of on a
    local cluster of the attempt's own; the tag reaches them through the forwarded environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len([p for p in workdir.iterdir() if p.name.startswith("attempt-")])
    adir = workdir / f"attempt-{n}"
    adir.mkdir()
    events, once, pid_file = adir / "events.jsonl", workdir / "fault-fired", workdir / "victim.pid"
    tag = f"{workdir.name}-{n}-{uuid.uuid4().hex[:8]}"
    run_env = {**os.environ, **(env or {}), TAG: tag, "MXPIPE_EVENTS_FILE": str(events),
               "MXPIPE_FAULT_ONCE_FILE": str(once)}
    if victim is not None:
        run_env.update({"MXPIPE_FAULT_KILL_STEP": str(kill_step), "MXPIPE_FAULT_KILL_RANK": str(killer_rank),
                        "MXPIPE_FAULT_KILL_PID_FILE": str(pid_file)})
    prefix = job.checkpoint_prefix.rsplit("/", 1)[0]
    cluster_id = f"chaos-{tag}"
    described = cluster.job_cluster() if cluster is not None else local_cluster(cluster_id, job.config,
                                                                                home=str(adir / "home"))
    done = threading.Event()
    if victim is not None:
        threading.Thread(target=_write_victim_pid, args=(adir / "home" / "clusters" / cluster_id / "procs", victim,
                                                         pid_file, done), daemon=True).start()
    started = time.monotonic()
    try:
        failed = supervise(job, storage.join(prefix, "job.json"), described, run_env)
    finally:
        done.set()
    seconds = time.monotonic() - started
    orphans = Watch(tags=[(TAG, tag)]).left(ORPHAN_WAIT_S)  # roles just exiting get that long
    evs = [json.loads(ln) for ln in events.read_text().splitlines()] if events.exists() else []
    return Attempt(failed=failed, events=evs, orphans=orphans, fault_at=once.stat().st_mtime if once.exists() else None,
                   seconds=seconds)


# -- facts about a run's checkpoints --------------------------------------------------------------


def store_facts(job: JobSpec) -> dict[str, Any]:
    """Folders, committed steps and the newest checkpoint that verifies, as restore will see them."""
    store = CheckpointStore(job.checkpoint_prefix, keep=job.config.checkpoint.keep)
    latest = store_for(job.checkpoint_prefix, job.config.checkpoint).latest()
    steps, committed = store.steps(), store.committed_steps()
    return {"steps": steps, "committed": committed, "torn": [s for s in steps if s not in committed],
            "latest_valid": latest.step if latest is not None else None}


def final_params(job: JobSpec) -> tuple[int, dict[str, np.ndarray]]:
    ckpt = store_for(job.checkpoint_prefix, job.config.checkpoint).latest()
    if ckpt is None:
        raise RuntimeError(f"no committed checkpoint under {job.checkpoint_prefix}")
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return ckpt.step, {k: arrays[k].copy() for k in arrays.files}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def flip_bytes(job: JobSpec, step: int, name: str = "params.npz") -> None:
    """Corrupt one committed checkpoint in place: its manifest no longer matches its bytes."""
    uri = CheckpointStore(job.checkpoint_prefix).file_uri(step, name)
    data = bytearray(storage.get_bytes(uri))
    data[len(data) // 2] ^= 0xFF
    storage.put_bytes(uri, bytes(data))


def final_step(job: JobSpec) -> int | None:
    """The global step the finished job's metrics record (None: the job did not finish)."""
    try:
        return int(json.loads(storage.get_bytes(job.metrics_uri))["global_step"])
    except Exception:  # noqa: BLE001 - no metrics: the job did not finish
        return None
