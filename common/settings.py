"""Every environment variable the project reads, in one typed place.

Each field of ``Settings`` is one variable (its alias is the variable's name), with its type,
default and what it does. Code reads ``settings().field``; nothing else in the project calls
``os.environ.get`` for its own configuration (``tests/unit/test_settings.py`` walks the code to
check, and docs/environment.md's table of variables against this class). A bad value fails with
pydantic's error, which names the variable and the expected type.

``settings()`` builds a fresh object from the current environment on each call (under 1 ms):
tests and the stack set variables at run time, and a role reads its settings once, outside its
training loop. Variables *passed through* to child processes (the role environment, the AWS
credentials boto3 reads by itself) are not configuration read here; only those the project's
own code interprets are. ``training.tracking.server.tracking_uri()`` is the one way to find
the MLflow server; ``secret(name)`` reads a variable whose *name* is configuration (an
encryption key).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The registered model the demo trains and the review DAG watches by default.
DEFAULT_MODEL_NAME = "digits-classifier"
DEFAULT_DATASET_URI = "s3://mxpipe/datasets/digits/digits.csv"
DEFAULT_ARTIFACT_ROOT = "s3://mxpipe/runs"


def _var(default: Any, name: str, doc: str, *, group: str, **bounds: Any) -> Any:
    return Field(default, validation_alias=AliasChoices(name), description=doc,
                 json_schema_extra={"env": name, "group": group}, **bounds)


class Settings(BaseSettings):
    """The project's environment variables (their table: docs/environment.md)."""

    model_config = SettingsConfigDict(case_sensitive=True, extra="ignore", populate_by_name=False,
                                      frozen=True)

    # --- the local stack -------------------------------------------------------------------
    home: str | None = _var(None, "MXPIPE_HOME", "Folder of the embedded stack's state (S3 data, "
                            "databases, logs, credentials); default `.local/` in the checkout", group="stack")
    pycache: str | None = _var(None, "MXPIPE_PYCACHE", "Bytecode cache folder of the stack's "
                               "processes; default `.local/pycache`", group="stack")
    pythonpath: str = _var("", "PYTHONPATH", "Kept after the checkout on the Airflow processes' "
                           "`PYTHONPATH`", group="stack")
    host_address: str | None = _var(None, "MXPIPE_HOST_ADDRESS", "This host's address in the namespace "
                                     "topology (`infra.topology` sets it on every server; the Airflow "
                                     "hosts' `hostname_callable`)", group="stack")

    # --- storage and tracking --------------------------------------------------------------
    artifact_root: str = _var(DEFAULT_ARTIFACT_ROOT, "MXPIPE_ARTIFACT_ROOT", "Root of every run's "
                              "partition (shards, checkpoints, model, reports)", group="storage")
    s3_endpoint_url: str | None = _var(None, "AWS_ENDPOINT_URL_S3", "S3 endpoint (wins over "
                                       "`AWS_ENDPOINT_URL`)", group="storage")
    endpoint_url: str | None = _var(None, "AWS_ENDPOINT_URL", "Endpoint of every AWS service "
                                    "(S3 when `AWS_ENDPOINT_URL_S3` is unset)", group="storage")
    aws_region: str = _var("us-east-1", "AWS_DEFAULT_REGION", "Region of the S3 client", group="storage")
    aws_access_key_id: str | None = _var(None, "AWS_ACCESS_KEY_ID", "Part of the S3 client cache "
                                         "key (boto3 reads the credentials itself)", group="storage")
    mlflow_tracking_uri: str | None = _var(None, "MLFLOW_TRACKING_URI", "MLflow tracking server "
                                           "(in Airflow, set by each task from its MLflow connection); "
                                           "unset: MLflow's own default", group="storage")
    live_tracking: bool = _var(True, "MXPIPE_LIVE_TRACKING", "The train task logs to the DAG run's "
                               "MLflow run while training runs (epoch metrics, role system metrics, "
                               "cost); `0` where no tracking server is reachable", group="storage")
    live_sync_s: float = _var(10.0, "MXPIPE_LIVE_SYNC_S", "Seconds between the train task's "
                              "live MLflow updates", group="storage")

    # --- the DAGs --------------------------------------------------------------------------
    schedule: str = _var("0 3 * * *", "MXPIPE_SCHEDULE", "Cron schedule (UTC) of the training "
                         "DAG, which also runs when the source dataset Asset is updated "
                         "(`none`: neither, triggered only)", group="dags")
    max_active_runs: int = _var(1, "MXPIPE_MAX_ACTIVE_RUNS", "Concurrent runs of the training DAG",
                                group="dags")
    retry_delay_s: float = _var(30.0, "MXPIPE_RETRY_DELAY_S", "First retry delay of `train` and "
                                "`register` (exponential backoff after it)", group="dags")
    train_timeout_s: float = _var(0.0, "MXPIPE_TRAIN_TIMEOUT_S", "The `train` task's "
                                  "`execution_timeout` in seconds, counted from its job's start: past it the "
                                  "job is stopped (emergency checkpoint first) and the task fails without a "
                                  "retry (0: none)", group="dags")
    train_deferrable: bool = _var(True, "MXPIPE_TRAIN_DEFERRABLE", "The `train` task defers while its job "
                                  "trains (no worker slot held); `0` where no triggerer runs: it polls the job "
                                  "itself, holding its slot (a retry still reconnects to the job)", group="dags")
    train_poll_s: float = _var(2.0, "MXPIPE_TRAIN_POLL_S", "How often the `train` task (its trigger, or "
                               "its own loop when not deferrable) reads its job's status record, in seconds: "
                               "the longest a failed job waits before Airflow retries it (one small S3 read per "
                               "running training per interval)", group="dags", gt=0)
    dagrun_timeout_s: float = _var(0.0, "MXPIPE_DAGRUN_TIMEOUT_S", "The training DAG's `dagrun_timeout` in "
                                   "seconds: past it the run fails and its training job is stopped (emergency "
                                   "checkpoint first; 0: none)", group="dags")
    reaper_schedule: str = _var("*/15 * * * *", "MXPIPE_REAPER_SCHEDULE", "Cron schedule (UTC) of "
                                "the `cluster_reaper` DAG (`none`: triggered only)", group="dags")
    dataset_uri: str = _var(DEFAULT_DATASET_URI, "MXPIPE_DATASET_URI", "The dataset the "
                            "`dataset_landed` asset stands for, and the training form's default",
                            group="dags")
    review_models: str = _var(DEFAULT_MODEL_NAME, "MXPIPE_REVIEW_MODELS", "Comma-separated "
                              "registered models the review DAG is scheduled on", group="dags")
    review_timeout_h: float = _var(72.0, "MXPIPE_REVIEW_TIMEOUT_H", "Hours a review waits for "
                                   "a reviewer", group="dags")
    shard_parts: int = _var(0, "MXPIPE_SHARD_PARTS", "Parts the training DAG's sharding is spread over (mapped "
                            "`shard_count` / `shard_part` tasks; the `shard_parts` Param wins): files of a "
                            "multi-file source, or byte ranges of one CSV file (no quoted newlines); `0`: one "
                            "per 256 MB of source, at most 8 and one per file; the shards are the same for any "
                            "number", group="dags", ge=0, le=64)
    sweep_parallel: int = _var(2, "MXPIPE_SWEEP_PARALLEL", "The `mxnet_sweep` DAG's cap on trials holding a "
                               "cluster at once (also its trial tasks' `max_active_tis_per_dagrun`, fixed when the "
                               "DAG is parsed); a run's `sweep.parallel` may be lower (its trials' gates keep it), a "
                               "sweep asking for more is refused", group="dags", ge=1, le=64)
    gx_data_docs: bool = _var(True, "MXPIPE_GX_DATA_DOCS", "Render the Great Expectations HTML "
                              "report (`0`: JSON report only)", group="dags")
    git_sha: str | None = _var(None, "MXPIPE_GIT_SHA", "Code version tagged on the MLflow run "
                               "(`mlflow.source.git.commit`; set in images, which have no `.git`); "
                               "unset: the checkout's `git rev-parse HEAD`", group="dags")

    # --- clusters --------------------------------------------------------------------------
    cluster_ttl_s: float = _var(6 * 3600.0, "MXPIPE_CLUSTER_TTL_S", "Age after which "
                                "`cluster_reaper` tears a cluster down", group="cluster")
    cluster_records: str = _var("", "MXPIPE_CLUSTER_RECORDS", "Folder (S3 or local) of the cluster "
                                "records (one `<id>.json` each, with its expiry), which provision, release, "
                                "retries and `cluster_reaper` on every Airflow worker read; empty: `clusters/` "
                                "beside `MXPIPE_ARTIFACT_ROOT`", group="cluster")
    single_host: bool = _var(False, "MXPIPE_SINGLE_HOST", "Every Airflow task runs on this one host "
                             "whatever the executor says: the `local` backend, refused under a "
                             "multi-host executor (CeleryExecutor), is allowed", group="cluster")
    hosts_file: str | None = _var(None, "MXPIPE_HOSTS_FILE", "JSON list of hosts of the `hosts` "
                                  "backend (the Airflow Variable `mxpipe_hosts` wins)", group="cluster")
    ec2_file: str | None = _var(None, "MXPIPE_EC2_FILE", "JSON object of EC2 options of the "
                                "`ec2` backend (the Airflow Variable `mxpipe_ec2` wins)", group="cluster")
    flush_denormals: bool = _var(False, "MXPIPE_FLUSH_DENORMALS", "Set by the launcher for each "
                                 "role from `cluster.flush_denormals`", group="cluster")
    node_host: str | None = _var(None, "DMLC_NODE_HOST", "Set by the cluster for each role of a "
                                 "distributed job: the address its ps-lite node binds, by which its supervisor "
                                 "names its host (the spot watcher's events name it so); unset: the machine's "
                                 "hostname", group="cluster")
    spot_watch: bool = _var(False, "MXPIPE_SPOT_WATCH", "Each role polls the EC2 instance metadata for its "
                            "instance's spot interruption notice and writes a `spot_interruption` event once "
                            "(`common.procs.spot`); set by the `ec2` backend when it runs on spot instances",
                            group="cluster")
    spot_notice_uri: str = _var("", "MXPIPE_SPOT_NOTICE_URI", "A folder (S3 or local) where a spot watcher also "
                                "records its notice, one object per instance: how the supervisor hears of it where "
                                "it cannot read the role's output while the role runs (SSM); set by the `ec2` "
                                "backend", group="cluster")
    spot_poll_s: float = _var(5.0, "MXPIPE_SPOT_POLL_S", "Seconds between a spot watcher's polls of the "
                              "interruption notice (AWS's advice: every 5 s; the notice comes two minutes "
                              "before the instance goes)", group="cluster", gt=0)
    ec2_metadata_endpoint: str = _var("http://169.254.169.254", "AWS_EC2_METADATA_SERVICE_ENDPOINT",
                                      "The EC2 instance metadata service the spot watcher polls (the AWS SDKs' "
                                      "own setting; tests point it at a local fake)", group="cluster")

    # --- fault injection and measurement (tests, benchmarks) --------------------------------
    fault_kill_step: int | None = _var(None, "MXPIPE_FAULT_KILL_STEP", "SIGKILL the chosen worker "
                                       "(or the pid in the pid file) at this global step", group="faults")
    fault_kill_steps: str = _var("", "MXPIPE_FAULT_KILL_STEPS", "Global steps, comma-separated: SIGKILL "
                                 "the chosen worker at each, once per step (with `MXPIPE_FAULT_ONCE_FILE`, one "
                                 "file per step: its name + `-<step>`)", group="faults")
    fault_kill_rank: int = _var(1, "MXPIPE_FAULT_KILL_RANK", "Worker rank the faults pick", group="faults")
    fault_kill_pid_file: str | None = _var(None, "MXPIPE_FAULT_KILL_PID_FILE", "File with the pid "
                                           "(negative: process group) the kill goes to", group="faults")
    fault_hang_step: int | None = _var(None, "MXPIPE_FAULT_HANG_STEP", "The chosen worker hangs "
                                       "at this global step (a stall)", group="faults")
    fault_term_step: int | None = _var(None, "MXPIPE_FAULT_TERM_STEP", "SIGTERM the chosen worker "
                                       "at this global step (a preemption)", group="faults")
    fault_kill_in_upload_step: int | None = _var(None, "MXPIPE_FAULT_KILL_IN_UPLOAD_STEP", "SIGKILL "
                                                 "rank 0 between this step's checkpoint files and "
                                                 "its manifest", group="faults")
    fault_step_delay_s: float | None = _var(None, "MXPIPE_FAULT_STEP_DELAY_S", "Every step of the "
                                            "chosen worker takes this much longer", group="faults")
    fault_once_file: str | None = _var(None, "MXPIPE_FAULT_ONCE_FILE", "A fault fires only if "
                                       "this file does not exist yet, and creates it", group="faults")
    events_file: str | None = _var(None, "MXPIPE_EVENTS_FILE", "JSON-lines file the supervisor "
                                   "appends its events to (recovery measurements); read from the "
                                   "environment it is given for the roles", group="faults")

    @property
    def s3_endpoint(self) -> str | None:
        """The S3 endpoint boto3 and s3fs use: the S3-specific variable, else the general one."""
        return self.s3_endpoint_url or self.endpoint_url

    @property
    def local_home(self) -> str:
        """The state folder, absolute: ``MXPIPE_HOME`` or ``<repo>/.local`` (git-ignored)."""
        return os.path.abspath(self.home or os.path.join(REPO_ROOT, ".local"))


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of the current environment (read now), or of ``environ`` alone.

    ``environ`` is for an environment that is a parameter rather than this process's: the one a
    supervisor was given for its roles.
    """
    if environ is None:
        return Settings()
    # The mapping as the one source, so nothing of this process's environment leaks in.
    return Settings(_build_sources=((InitSettingsSource(Settings, dict(environ)),), {}))


def secret(name: str) -> str | None:
    """The value of a variable whose *name* is configuration (``checkpoint.encryption_key_env``):
    a secret, never a field here, so it is not in any table, log or model dump."""
    return os.environ.get(name) or None


def env_table() -> str:
    """The table of variables in docs/environment.md, generated from ``Settings`` (scripts/gen_docs.py)."""
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for field in Settings.model_fields.values():
        extra = field.json_schema_extra or {}
        ann = str(field.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        ann = ann.replace(" | None", ", optional")  # a bare | would split the Markdown cell
        default = "—" if field.default is None else "empty" if field.default == "" else f"`{field.default}`"
        rows.append(f"| `{extra['env']}` | {ann} | {default} | {field.description} |")
    return "\n".join(rows)
