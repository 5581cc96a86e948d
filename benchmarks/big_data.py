"""Big data through the DAG: a generated Parquet table of ``--gb`` gigabytes (``--files`` files)
goes through shard → validate → train one epoch → register, in the training DAG on the real
Airflow stack (api-server, scheduler with the LocalExecutor, dag-processor, triggerer; the roles
on the ``local`` backend) against a SeaweedFS S3 and an MLflow server of the benchmark's own
(as ``operator_durability.py``). Reports each stage's throughput and each task's peak memory.

    nice -n 10 .venv/bin/python benchmarks/big_data.py --gb 1 4 [--files N] [--cols C] [--parts P]
        [--json OUT] [--plot PNG]
    .venv/bin/python benchmarks/big_data.py --merge A.json B.json --json OUT   # one JSON, plot, tables

- The table: ``--cols`` float32 features ``f0…`` and a ``label`` of 10 classes, the argmax of a
  fixed random projection of the features (learnable: one epoch gets well past chance). Written
  file by file (one Parquet file in a temp folder, uploaded, deleted), so the benchmark's own
  memory and disk follow one file, not the table. Each size is a table of its own (other
  content: no shards are reused), under ``s3://<bucket>/big/<gb>gb/``.
- The run: ``mxnet_training`` triggered through the REST API (``infra.airflow_client``) with the
  ``debug`` recipe, 1 epoch, early stopping off, 2 workers + 1 server on the ``local`` backend,
  ``force`` on, ``shard_parts`` = ``--parts``.
- Memory, sampled every second: every Airflow task process (its title is ``airflow worker --
  <task instance id>``, set by the task runner; the id is the REST API's task instance ``id``),
  and every role and supervisor process of the run (``testkit.operator_runs.role_processes``: the
  processes whose environment carries the run's cluster id). Per process its peak RSS (the
  kernel's high-water mark ``VmHWM``, so a spike between samples counts) and the peak of its
  anonymous RSS (``RssAnon``, sampled): a worker memory-maps its shards, and the mapped pages it
  touched count in its RSS while the kernel may drop them at will; anonymous memory is what it
  holds. Per task the figures of its process and its children.
- Throughput per stage, from the task instances' start and end (the span from the first start
  to the last end of the stage's tasks): shard (``shard``, ``shard_parts``, ``shard_count``,
  ``shard_part``, ``shard_merge``), validate (``shard_names``, ``validate_shard``, ``validate``),
  train, register; MB/s of source table and rows/s (train: the train split's rows, one epoch).

Every server and process it starts is stopped on any way out (the stack's components by process
group, the run's roles by pid). With ``--json`` the figures of every size go to that file (sizes
already there and not run again are kept, so runs of separate invocations add up), and the plot
(``--plot``, default beside the JSON) shows each task's peak RSS for each size.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.operator_durability import _servers  # noqa: E402
from testkit.dag_services import embedded_services, use_in_this_process  # noqa: E402
from testkit.periodic import PeriodicSampler  # noqa: E402
from testkit.result_file import write_json  # noqa: E402

DAG_ID = "mxnet_training"
CLASSES = 10
TITLE = re.compile(r"^airflow worker -- ([0-9a-f-]{36})")
STAGES = {"shard": ("shard", "shard_parts", "shard_count", "shard_part", "shard_merge"),
          "validate": ("shard_names", "validate_shard", "validate"),
          "train": ("train",), "register": ("register",)}
MB = 1 << 20


# --- the table -------------------------------------------------------------------------------------

def write_table(prefix: str, gb: float, files: int, cols: int, tmp: str) -> dict[str, Any]:
    """``files`` Parquet files of together about ``gb`` GB under ``prefix``: float32 features and a
    learnable label; each file written locally, uploaded, deleted. Returns rows and bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common import storage

    projection = np.random.default_rng(0).standard_normal((cols, CLASSES)).astype(np.float32)
    # float32 noise does not compress: a row takes its raw bytes in the file (+ the int8 label).
    rows_per_file = max(1, int(gb * (1 << 30) / files / (4 * cols + 1)))
    names = [f"f{j}" for j in range(cols)]
    total_bytes, started = 0, time.monotonic()
    for i in range(files):
        rng = np.random.default_rng([1, i])
        X = rng.standard_normal((rows_per_file, cols), dtype=np.float32)
        label = (X @ projection).argmax(axis=1).astype(np.int8)
        table = pa.Table.from_arrays([*(pa.array(X[:, j]) for j in range(cols)), pa.array(label)],
                                     names=[*names, "label"])
        del X
        local = os.path.join(tmp, f"part-{i:05d}.parquet")
        # Row groups of ~64 MB: the sharder reads a Parquet file by row group.
        # Plain encoding: dictionary pages of random floats only add bytes (1.5 × the raw size).
        pq.write_table(table, local, compression="none", use_dictionary=False,
                       row_group_size=max(1, (64 * MB) // (4 * cols + 1)))
        del table
        total_bytes += os.path.getsize(local)
        storage.upload_file(local, f"{prefix}part-{i:05d}.parquet")
        os.remove(local)
    seconds = time.monotonic() - started
    return {"rows": rows_per_file * files, "bytes": total_bytes, "files": files, "cols": cols,
            "generate_s": round(seconds, 1), "generate_mb_per_s": round(total_bytes / MB / seconds, 1)}


# --- memory ----------------------------------------------------------------------------------------

def _status_kb(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``RssAnon`` (kB) of ``pid`` from ``/proc/PID/status``; {} when gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon"):
                    out[key] = int(value.split()[0])
    except OSError:
        return {}
    return out


class MemorySampler(PeriodicSampler):
    """Every ``interval_s``: each task process (by its title) and each of the run's role processes,
    with their children; per key the peak ``VmHWM`` (summed over the tree) and peak ``RssAnon``."""

    def __init__(self, run_id: str, interval_s: float = 1.0) -> None:
        super().__init__(interval_s, "memory-sampler")
        self.run_id = run_id
        self.tasks: dict[str, dict[str, float]] = {}  # task instance id → peaks
        self.roles: dict[str, dict[str, float]] = {}  # role name → peaks
        self.samples = 0

    @staticmethod
    def _tree(proc: Any) -> tuple[float, float, float]:
        """Summed VmHWM, VmRSS and RssAnon (MB) of a process and its descendants."""
        import psutil

        hwm = rss = anon = 0.0
        with contextlib.suppress(psutil.Error):
            for p in [proc, *proc.children(recursive=True)]:
                s = _status_kb(p.pid)
                hwm += s.get("VmHWM", 0) / 1024
                rss += s.get("VmRSS", 0) / 1024
                anon += s.get("RssAnon", 0) / 1024
        return hwm, rss, anon

    @staticmethod
    def _peak(into: dict[str, dict[str, float]], key: str, figures: tuple[float, float, float]) -> None:
        got = into.setdefault(key, {"peak_rss_mb": 0.0, "peak_sampled_rss_mb": 0.0, "peak_anon_mb": 0.0})
        for name, value in zip(("peak_rss_mb", "peak_sampled_rss_mb", "peak_anon_mb"), figures):
            got[name] = round(max(got[name], value), 1)

    def _role_name(self, proc: Any) -> str:
        env = proc.environ()
        role = env.get("DMLC_ROLE")
        if role == "worker":
            return f"worker (pid {proc.pid})"
        if role:
            return role
        return "supervisor" if "supervise" in " ".join(proc.cmdline()) else f"other (pid {proc.pid})"

    def sample(self) -> None:
        import psutil

        from testkit.operator_runs import role_processes

        for proc in psutil.process_iter(["cmdline"]):
            m = TITLE.match(" ".join(proc.info["cmdline"] or []))
            if m:
                self._peak(self.tasks, m.group(1), self._tree(proc))
        for pid in role_processes(self.run_id):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                # A role's own figures: the supervisor's children are the roles, counted apart.
                s = _status_kb(pid)
                self._peak(self.roles, self._role_name(proc),
                           (s.get("VmHWM", 0) / 1024, s.get("VmRSS", 0) / 1024, s.get("RssAnon", 0) / 1024))
        self.samples += 1


class DiskSampler(PeriodicSampler):
    """Every ``interval_s``: the filesystem's used bytes and the store's folder (SeaweedFS's volume
    files), for the peak above the start and a timeline. Two duties beside measuring:

    - **Reclaim.** SeaweedFS frees a deleted object's bytes only when it compacts ("vacuums") the
      volume; its master does so every 14 min on its own. The merge deletes the parts' pieces (as
      many bytes as the shards) once the manifest is committed, and the workers download their
      shards soon after, so the benchmark asks the master to vacuum as soon as ``shard_merge`` has
      succeeded, as the store's operator would; on S3 a deletion frees the space at once.
    - **Guard.** Below ``min_free`` bytes free, this process gets SIGTERM: it unwinds like an
      interrupt (every server and role stopped) instead of a task failing on a full disk with the
      machine's other work.
    """

    def __init__(self, airflow_url: str, run_id: str, store_dir: Path, master_url: str, interval_s: float = 10.0,
                 min_free: int = 3 << 30) -> None:
        super().__init__(interval_s, "disk-sampler", join_timeout_s=60)
        self.airflow_url, self.run_id, self.store_dir, self.master_url = airflow_url, run_id, store_dir, master_url
        self.min_free = min_free
        self.started = time.time()
        self.start_used = shutil.disk_usage(store_dir).used
        self.timeline: list[tuple[float, float, float]] = []  # (seconds, GB used above the start, store GB)
        self.vacuum: dict[str, Any] = {}
        self.guard_tripped = False
        self.load_max = 0.0  # the 1-minute load average's peak: whether the machine was the run's alone

    def _store_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.store_dir.rglob("*") if f.is_file())

    def _merged(self) -> bool:
        from infra.airflow_client import AirflowClient

        if not self.run_id:  # the table is still being written
            return False
        with AirflowClient(self.airflow_url) as client:
            return any(t["task_id"] == "shard_merge" and t.get("state") == "success"
                       for t in client.task_instances(DAG_ID, self.run_id))

    def _reclaim(self) -> None:
        import urllib.request

        before, started = self._store_bytes(), time.monotonic()
        # Volumes with over 10 % deleted bytes are compacted; the call returns when they are done.
        with urllib.request.urlopen(f"{self.master_url}/vol/vacuum?garbageThreshold=0.1", timeout=1800) as reply:
            reply.read()
        self.vacuum = {"at_s": round(time.time() - self.started, 1), "seconds": round(time.monotonic() - started, 1),
                       "store_gb_before": round(before / 1e9, 2), "store_gb_after": round(self._store_bytes() / 1e9, 2)}
        print(f"store vacuumed: {json.dumps(self.vacuum)}", flush=True)

    def sample(self) -> None:
        usage = shutil.disk_usage(self.store_dir)
        self.load_max = max(self.load_max, round(os.getloadavg()[0], 1))
        self.timeline.append((round(time.time() - self.started, 1), round((usage.used - self.start_used) / 1e9, 2),
                              round(self._store_bytes() / 1e9, 2)))
        if usage.free < self.min_free and not self.guard_tripped:
            self.guard_tripped = True
            print(f"disk guard: {usage.free / 1e9:.1f} GB free, stopping the benchmark", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if not self.vacuum and self._merged():
            self._reclaim()

    def figures(self) -> dict[str, Any]:
        peak = max(self.timeline, key=lambda s: s[1], default=(0.0, 0.0, 0.0))
        return {"started_at": round(self.started, 1), "peak_used_above_start_gb": peak[1], "peak_at_s": peak[0],
                "peak_store_gb": max((s[2] for s in self.timeline), default=0.0), "vacuum": self.vacuum,
                "guard_tripped": self.guard_tripped, "timeline": self.timeline}

    def sample_failed(self, exc: Exception) -> None:  # a file gone mid-walk, the API busy: the next sample counts
        print(f"disk sample failed: {exc!r}", flush=True)


# --- the run ---------------------------------------------------------------------------------------

def run_conf(uri: str, parts: int, gb: float) -> dict[str, Any]:
    return {"dataset_uri": uri, "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 1,
            "batch_size": 256, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
            "kvstore": "dist_sync", "backend": "local", "checkpoint_every_n_steps": 1_000_000,
            "config": {"optim": {"early_stopping_patience": 0}},
            "registered_model_name": f"big-data-{gb:g}gb".replace(".", "_"), "shard_parts": parts, "force": True}


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def stage_figures(tis: list[dict[str, Any]], source_bytes: int, rows: dict[str, int]) -> dict[str, Any]:
    """Per stage: its span (first start → last end of its tasks), MB/s of the source and rows/s."""
    out = {}
    for stage, task_ids in STAGES.items():
        # Ended tasks that ran: a skipped or upstream-failed task has dates but did no work.
        mine = [t for t in tis if t["task_id"] in task_ids and t.get("state") in ("success", "failed")
                and t.get("start_date") and t.get("end_date")]
        if not mine:
            continue
        first, last = min(_ts(t["start_date"]) for t in mine), max(_ts(t["end_date"]) for t in mine)
        span = last - first
        n = rows["train"] if stage == "train" else rows["test"] if stage == "register" else rows["all"]
        out[stage] = {"seconds": round(span, 1), "tasks": len(mine), "rows": n, "start": round(first, 1),
                      "end": round(last, 1),
                      "mb_per_s": round(source_bytes / MB / span, 2) if span else None,
                      "rows_per_s": round(n / span) if span else None}
    return out


def manifest_rows(artifact_root: str, source_prefix: str) -> dict[str, int]:
    """Rows per split of the (one) manifest sharded from ``source_prefix``."""
    from common import storage

    for uri in storage.list_uris(storage.join(artifact_root, "datasets")):
        if uri.endswith("/manifest.json"):
            manifest = json.loads(storage.get_bytes(uri))
            if manifest.get("source_uri") == source_prefix:
                return {"all": int(manifest["stats"]["rows"]),
                        **{split: int(v["count"]) for split, v in manifest["splits"].items()}}
    raise LookupError(f"no manifest sharded from {source_prefix}")


def train_figures(s3_root: str, run_id: str, rows: dict[str, int]) -> dict[str, Any]:
    """The training loop's own rate (rank 0's epoch record: rows a second over all workers, the
    job's start-up and the epoch-end validation and checkpoint left out), or, for a job still
    running, its progress: steps done and rows a second since it started (its status record)."""
    from common import storage
    from common.paths import RunPaths
    from training.launch.status import read_status

    paths = RunPaths(root=s3_root, dag_id=DAG_ID, run_id=run_id)
    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # no job, or no metrics yet
        status = read_status(paths.job_status)
        if status is not None:
            out.update(job_state=status.state, global_step=status.global_step,
                       job_seconds=round(time.time() - status.started_at, 1) if status.started_at else None)
    with contextlib.suppress(Exception):
        history = json.loads(storage.get_bytes(storage.join(paths.metrics, "train.json")))["history"]
        out.update(loop_rows_per_s=round(history[0]["samples_per_s_total"]),
                   val_accuracy=history[0].get("val_accuracy"))
    return out


def run_size(cfg: Any, bucket: str, s3_root: str, gb: float, args: argparse.Namespace, tmp: str,
             started_runs: list[str], store: tuple[Path, str]) -> dict[str, Any]:
    """One size: its table written, the DAG run on it sampled, its figures; the table deleted after.
    ``store``: the S3 store's data folder and its master's URL (disk figures, reclaiming)."""
    from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag_run

    prefix = f"s3://{bucket}/big/{gb:g}gb/"
    with DiskSampler(cfg.airflow_url, "", *store) as disk:
        table = write_table(prefix, gb, args.files, args.cols, tmp)
        print(f"table {gb:g} GB: {json.dumps(table)}", flush=True)
        run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, run_conf(prefix, args.parts, gb))
        started_runs.append(run_id)
        disk.run_id = run_id
        with MemorySampler(run_id) as sampler:
            try:
                state = wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=args.timeout_s, poll_s=5)
            except TimeoutError:  # the figures of the stages that ended are still measured
                state = "timeout"
    with AirflowClient(cfg.airflow_url) as client:
        tis = client.task_instances(DAG_ID, run_id)
        # A failed task's last log lines, for the report (the stack's logs go with its folder).
        failed = {f"{t['task_id']}[{t.get('map_index', -1)}]":
                  [str(e.get("event", ""))[:400] for e in client.task_log(
                      DAG_ID, run_id, t["task_id"], max(1, t.get("try_number") or 1), t.get("map_index", -1))][-15:]
                  for t in tis if t.get("state") == "failed"}
    try:
        rows = manifest_rows(s3_root, prefix)
    except LookupError:  # the shard step failed: no manifest
        rows = {"all": table["rows"], "train": 0, "val": 0, "test": 0}
    tasks = {}
    for ti in tis:
        name = ti["task_id"] if ti.get("map_index", -1) < 0 else f"{ti['task_id']}[{ti['map_index']}]"
        if ti["id"] in sampler.tasks:
            tasks[name] = dict(sampler.tasks[ti["id"]])
            if ti.get("start_date") and ti.get("end_date"):  # its own span, for the planner's per-step check
                tasks[name]["seconds"] = round(_ts(ti["end_date"]) - _ts(ti["start_date"]), 1)
    result_train = train_figures(s3_root, run_id, rows)
    result = {"gb": gb, "parts": args.parts, "load_average_1min_max": disk.load_max, "state": state,
              "training": result_train, "run_id": run_id, "table": table, "rows": rows, "failed": failed,
              "disk": disk.figures(),
              "stages": stage_figures(tis, table["bytes"], rows), "tasks": dict(sorted(tasks.items())),
              "roles": dict(sorted(sampler.roles.items())), "samples": sampler.samples}
    print(json.dumps(result, indent=1), flush=True)
    # The next size's table and shards get the disk: this size's are measured.
    from common import storage

    storage.delete_prefix(prefix)
    return result


@contextlib.contextmanager
def roles_killed_on_the_way_out(run_ids: list[str]) -> Iterator[None]:
    """The runs' detached supervisors and roles outlive the stack by design: killed on any way out."""
    import psutil

    from testkit.operator_runs import role_processes

    try:
        yield
    finally:
        for run_id in run_ids:
            for pid in role_processes(run_id):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Peak RSS of each task (and role) for each size, side by side: flat bars mean bounded memory."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import numpy as np

    keys = sorted({k for r in runs for k in r["tasks"]} | {f"role {k}" for r in runs for k in r["roles"]
                                                          if not k.startswith("worker (")} |
                  ({"role worker (max)"} if any(k.startswith("worker (") for r in runs for k in r["roles"]) else set()))

    def value(run: dict[str, Any], key: str, field: str) -> float:
        if key == "role worker (max)":
            return max((v[field] for k, v in run["roles"].items() if k.startswith("worker (")), default=0.0)
        if key.startswith("role "):
            return run["roles"].get(key[5:], {}).get(field, 0.0)
        return run["tasks"].get(key, {}).get(field, 0.0)

    fig, axes = plt.subplots(1, 2, figsize=(14, max(4, 0.3 * len(keys) + 1.5)), sharey=True)
    y = np.arange(len(keys))
    height = 0.8 / max(1, len(runs))
    for ax, field, title in ((axes[0], "peak_rss_mb", "peak RSS (VmHWM), MB"),
                             (axes[1], "peak_anon_mb", "peak anonymous RSS (RssAnon), MB")):
        for i, run in enumerate(sorted(runs, key=lambda r: r["gb"])):
            ax.barh(y + i * height, [value(run, k, field) for k in keys], height=height,
                    label=f"{run['table']['bytes'] / (1 << 30):.1f} GB table")
        ax.set_title(title)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(y + height * (len(runs) - 1) / 2, keys, fontsize=8)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8)
    fig.suptitle("mxnet_training: peak memory per task and role, by table size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_disk(runs: list[dict[str, Any]], path: str) -> None:
    """Disk over each run: the filesystem's use above the start and the store's folder, the table's
    generation, each stage's span (where recorded) and the store's vacuum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.get("disk", {}).get("timeline")]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], sorted(runs, key=lambda r: r["gb"])):
        disk = run["disk"]
        t, used, store = zip(*disk["timeline"])
        minutes = [x / 60 for x in t]
        ax.plot(minutes, used, label="filesystem used above the start (store, local temp files, logs)")
        ax.plot(minutes, store, label="S3 store's folder (SeaweedFS volumes)")
        ax.axvspan(0, run["table"]["generate_s"] / 60, color="grey", alpha=0.15, label="table generated")
        for i, (stage, st) in enumerate(run["stages"].items()):
            if "start" in st and "started_at" in disk:
                ax.axvspan((st["start"] - disk["started_at"]) / 60, (st["end"] - disk["started_at"]) / 60,
                           color=f"C{i + 2}", alpha=0.15, label=stage)
        if disk.get("vacuum"):
            ax.axvline(disk["vacuum"]["at_s"] / 60, color="k", ls="--", lw=1, label="store vacuumed")
        ax.set_title(f"{run['table']['bytes'] / 1e9:.1f} GB table: peak {disk['peak_used_above_start_gb']:.1f} GB "
                     f"above the start")
        ax.set_xlabel("minutes since the table's generation began")
        ax.set_ylabel("GB")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(runs: list[dict[str, Any]]) -> str:
    """The per-stage throughput and the per-task (and role) peak memory of each size, as tables."""
    sizes = [f"{r['table']['bytes'] / (1 << 30):.2f} GiB" for r in runs]
    lines = ["| stage | " + " | ".join(sizes) + " |", "|---" * (len(runs) + 1) + "|"]
    for stage in STAGES:
        cells = []
        for r in runs:
            st = r["stages"].get(stage)
            cells.append(f"{st['seconds']:.0f} s, {st['mb_per_s']:.1f} MB/s, {st['rows_per_s']:,} rows/s" if st else "–")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines += ["", "| task / role: peak RSS (anonymous) MB | " + " | ".join(sizes) + " |",
              "|---" * (len(runs) + 1) + "|"]
    keys = sorted({k for r in runs for k in r["tasks"]})
    for key in keys:
        cells = [f"{r['tasks'][key]['peak_rss_mb']:.0f} ({r['tasks'][key]['peak_anon_mb']:.0f})"
                 if key in r["tasks"] else "–" for r in runs]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    for role in ("scheduler", "server", "supervisor", "worker"):
        cells = []
        for r in runs:
            got = [v for k, v in r["roles"].items() if k == role or (role == "worker" and k.startswith("worker ("))]
            cells.append(f"{max(v['peak_rss_mb'] for v in got):.0f} ({max(v['peak_anon_mb'] for v in got):.0f})"
                         if got else "–")
        lines.append(f"| role {role}{' (max)' if role == 'worker' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, nargs="+", default=[1.0], help="table sizes (GB), run in turn")
    parser.add_argument("--files", type=int, default=0, help="Parquet files per table (0: one per 128 MB)")
    parser.add_argument("--cols", type=int, default=128, help="float32 feature columns")
    parser.add_argument("--parts", type=int, default=2, help="the shard_parts Param (mapped shard tasks)")
    parser.add_argument("--timeout-s", type=float, default=6 * 3600, help="bound on each DAG run")
    parser.add_argument("--json", help="write (add to) the figures in this file")
    parser.add_argument("--plot", help="the PNG (default: the JSON's name with .png)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="run nothing: put the sizes of these result files into --json (a later file's size "
                             "replaces an earlier one's) and plot them")
    args = parser.parse_args()
    if args.merge:
        merged: dict[float, dict[str, Any]] = {}
        for path in args.merge:
            with open(path) as fh:
                merged.update({r["gb"]: r for r in json.load(fh)["runs"]})
        runs = [merged[gb] for gb in sorted(merged)]
        write_json(args.json, {"runs": runs})
        plot(runs, args.plot or os.path.splitext(args.json)[0] + ".png")
        plot_disk(runs, os.path.splitext(args.json)[0] + "_disk.png")
        print(markdown(runs))
        return 0
    # A TERM (``timeout``, a kill by pid) unwinds like an interrupt: every ``finally`` below stops
    # what it started (the stack's components by process group, the servers, the run's roles).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from testkit.airflow_stack import airflow_stack

    runs: list[dict[str, Any]] = []
    if args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            runs = [r for r in json.load(fh).get("runs", []) if r["gb"] not in args.gb]
    with tempfile.TemporaryDirectory(prefix="mxpipe-bigdata-") as tmp:
        root = Path(tmp)
        with embedded_services(root) as (cfg, services):
            use_in_this_process(services)
            s3, mlflow = _servers(cfg, services)
            with airflow_stack(root / "airflow", s3, mlflow, {DAG_ID: "mxnet_training.py"}) as stack, \
                    contextlib.ExitStack() as exits:
                started: list[str] = []
                exits.enter_context(roles_killed_on_the_way_out(started))
                for gb in args.gb:
                    files = args.files or max(2, round(gb * 8))
                    one = argparse.Namespace(**{**vars(args), "files": files})
                    store = (cfg.home / "s3", f"http://{cfg.s3_host}:{cfg.weed_master_port}")
                    runs.append(run_size(stack, cfg.bucket, s3.env["MXPIPE_ARTIFACT_ROOT"], gb, one, tmp, started,
                                         store))
                    if args.json:
                        write_json(args.json, {"runs": sorted(runs, key=lambda r: r["gb"])})
    runs.sort(key=lambda r: r["gb"])
    if args.json:
        write_json(args.json, {"runs": runs})
        plot(runs, args.plot or os.path.splitext(args.json)[0] + ".png")
        plot_disk(runs, os.path.splitext(args.json)[0] + "_disk.png")
    return 0 if all(r["state"] == "success" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
