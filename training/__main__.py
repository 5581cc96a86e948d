"""Command line of the trainer; runs with no Airflow at all.

    python -m training run --config cfg.json --shards PREFIX --out PREFIX
        Runs the distributed job (1 scheduler, S servers, W workers as local processes) over
        shards written by ``python -m data_checks shard``; checkpoints, metrics and the exported
        model go under ``--out``. Rerunning the same command resumes from the latest checkpoint.
        The job runs as a DAG run's does (``training.launch.detached``): its supervisor detached
        on a local cluster (the job document names ``infra.cluster:attach``, never imported
        here), its status record at ``--out``/config/job_status.json, its log under
        ``$MXPIPE_HOME/jobs/``; Ctrl-C stops it in order (rank 0's emergency checkpoint first).
        A missing or invalid config file: one line on stderr, exit code 2; a failed job: 1.

    python -m training config [--recipe digits|debug] [--dataset URI]
        Prints a recipe's full config as JSON: a config file to start from.

    python -m training supervise JOB_URI --job-id ID [--attempt N]
        The supervisor of one job as a process of its own (started detached by the cluster):
        starts every role on the cluster the job document names, keeps the status record,
        stops every role on SIGTERM (rank 0's emergency checkpoint first). Exit code: 0
        succeeded, 1 failed (retryable), 2 failed deterministically, 4 refused (another live
        job on the same prefix), 75 stopped (training.launch.supervise).

    python -m training worker JOB_URI
        One worker role (started by the launcher with the DMLC_* variables set).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
from typing import Any

from common.cli import parser as cli_parser
from common.cli import usage_errors
from common.fpmode import apply_from_env
from common.mx import import_mxnet

EXAMPLES = """
python -m training config --recipe digits --dataset s3://mxpipe/datasets/digits/digits.csv > cfg.json
python -m data_checks shard --config cfg.json --out s3://mxpipe/manual/shards
python -m training run --config cfg.json --shards s3://mxpipe/manual/shards --out s3://mxpipe/manual/run
"""


def _worker(job_uri: str) -> int:
    from common.errors import DeterministicError
    from common.events import EXIT_BAD_INPUT, EXIT_NAN_LOSS
    from training.launch.job import JobSpec
    from training.loop.worker import NaNLossError, run

    log = logging.getLogger("training.loop.worker")
    # The supervisor sends SIGUSR1 to a stalled local worker before stopping it: every thread's
    # Python stack goes to the role's output, so a stall report says where the worker waited.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Only a DeterministicError (bad input, config, data) says "do not retry"; anything else, a
    # library's plain ValueError included, propagates: its traceback in the role's output, exit
    # code 1, a failure a retry may fix.
    try:
        run(JobSpec.load(job_uri))
    except NaNLossError as exc:  # deterministic too, with a code of its own
        log.error("%s", exc)
        return EXIT_NAN_LOSS
    except DeterministicError as exc:
        log.error("bad input: %s", exc)
        return EXIT_BAD_INPUT
    # The kvstore's destructor (engine drain, ps-lite's exit barrier with every other worker,
    # finalize) runs when the trainer that holds it is collected; gluon's Trainer and its
    # Parameters form a reference cycle, so without this that is whenever the collector or the
    # interpreter's teardown gets to it. Here it happens at one known point, with the
    # interpreter intact, and a worker that waits in the barrier has said so in its log.
    log.info("training done: leaving the kvstore (exit barrier with the other workers)")
    gc.collect()
    log.info("kvstore closed")
    return 0


def _run(args: argparse.Namespace) -> int:
    import math
    import uuid

    from common import model_code, storage
    from common.config import ConfigError, TrainConfig
    from common.paths import safe_component
    from training.launch.detached import local_cluster, run_detached
    from training.launch.job import JobSpec
    from training.launch.launcher import JobFailed
    from training.launch.supervise import cluster_of

    out = args.out.rstrip("/")
    with usage_errors(ConfigError):
        cfg = TrainConfig.from_file(args.config)
        # A custom network's code travels with the job as in a DAG run (common.model_code).
        code = model_code.stage(cfg.model.code_uri, storage.join(out, "code")) if cfg.model.code_uri else None
    # The job runs as a DAG run's does: a detached supervisor on a local cluster of this command's
    # own (a second command on the same --out is refused by the status record, and its teardown
    # cannot touch the first one's processes).
    job = JobSpec(config=cfg, shards_prefix=args.shards, checkpoint_prefix=storage.join(out, "checkpoints"),
                  model_prefix=storage.join(out, "model"), metrics_uri=storage.join(out, "metrics", "train.json"),
                  model_code_uri=code.uri if code else "", model_code_sha256=code.sha256 if code else "",
                  status_uri=storage.join(out, "config", "job_status.json"),
                  cluster=local_cluster(safe_component(f"run-{uuid.uuid4().hex[:8]}-{out}"), cfg))
    job_uri = storage.join(out, "config", "job.json")
    # The previous command's cluster: what a supervisor that died mid-run may have left (stopped
    # and torn down only if the status record shows that job active with its supervisor gone).
    replaced = [JobSpec.load(job_uri).cluster] if storage.exists(job_uri) else []
    job.save(job_uri)
    # The supervisor bounds the job itself (cluster.job_timeout_s, stalls); this only bounds the wait.
    c = cfg.cluster
    try:
        run_detached(job_uri, env=os.environ, timeout_s=c.job_timeout_s + 300.0 if c.job_timeout_s else math.inf,
                     replaced_clusters=replaced)
    except JobFailed as exc:
        print(f"training failed: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster_of(job).teardown()  # the cluster's records (its supervisor's log stays under $MXPIPE_HOME/jobs)
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    print(json.dumps({"model": job.model_prefix, "checkpoints": job.checkpoint_prefix,
                      "final": metrics["history"][-1]}, indent=2))
    return 0


def _live_run(job: Any, cluster: Any) -> Any:
    """The job's live MLflow run (``JobSpec.tracking``; None when off), with the cluster's own
    cost (EC2 instance-hours and price) where it has one."""
    from training.tracking.live import live_run_for

    c = job.config.cluster
    return live_run_for(job.tracking, gpus_per_worker=c.devices_per_worker if c.device == "gpu" else 0,
                        cost_extras=getattr(cluster, "cost", None))


def _supervise(args: argparse.Namespace) -> int:
    from training.launch.supervise import SuperviseError, supervise

    with usage_errors(SuperviseError):
        return supervise(args.job_uri, job_id=args.job_id, attempt=args.attempt, observer_for=_live_run)


def _print_config(args: argparse.Namespace) -> int:
    from common.config import ConfigError, recipe

    with usage_errors(ConfigError):
        cfg = recipe(args.recipe, args.dataset)
    print(cfg.to_json())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("The trainer without Airflow: a distributed MXNet job (scheduler, servers, workers) "
                        "as local processes, over shards written by python -m data_checks shard.",
                        EXAMPLES, prog="python -m training")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run one worker role (started by the launcher)")
    w.add_argument("job_uri")
    s = sub.add_parser("supervise", help="supervise one job's roles to its end (started detached by a cluster)")
    s.add_argument("job_uri")
    s.add_argument("--job-id", required=True, help="this job's id, as its status record will carry it")
    s.add_argument("--attempt", type=int, default=0, help="the Airflow try that started it (0: none)")
    r = sub.add_parser("run", help="run a distributed job on local processes; rerun to resume")
    r.add_argument("--config", required=True, help="TrainConfig JSON file")
    r.add_argument("--shards", required=True, help="prefix holding manifest.json and the shards")
    r.add_argument("--out", required=True, help="prefix for checkpoints, metrics and the model")
    c = sub.add_parser("config", help="print a recipe's full config as JSON, to start a config file from")
    c.add_argument("--recipe", default="digits", help="digits (default) or debug")
    c.add_argument("--dataset", default="", help="data.source_uri of the config")
    args = parser.parse_args(argv)
    if args.cmd == "config":
        return _print_config(args)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A role, and the supervisor (a pipe per role), hold descriptors in proportion to the job's
    # roles (ps-lite connects every role to every other one): common.procs.limits.
    if args.cmd in ("worker", "supervise", "run"):
        from common.procs.limits import raise_open_files_limit

        raise_open_files_limit()
    if args.cmd == "worker":
        from common.procs.spot import watch_spot
        from common.procs.watchdog import watch_supervisor

        watch_supervisor()  # a role exits on its own once its supervisor is gone
        watch_spot()  # on a spot instance (MXPIPE_SPOT_WATCH), its interruption notice becomes an event
        apply_from_env()  # the floating-point mode the engine's threads inherit: before mxnet starts them
        import_mxnet()  # before anything else can import mxnet with sklearn present
        return _worker(args.job_uri)
    if args.cmd == "supervise":
        return _supervise(args)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
