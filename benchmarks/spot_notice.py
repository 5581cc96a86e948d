#!/usr/bin/env python
"""S1: what a spot interruption notice costs, against a crash at the same moment.

Real local jobs (2 ``dist_sync`` workers, 1 server, the optimizer on the workers, the debug
recipe on digits × ``--copies``, a checkpoint every ``--every-n-steps``) with every role's spot
watch on, pointed at a fake metadata endpoint (``testkit.metadata_server``, through the AWS SDKs'
``AWS_EC2_METADATA_SERVICE_ENDPOINT``), whose notice is switched on once rank 0 has reached each
of ``--notice-steps`` (one job each; ``testkit.spot_runs``). Per job: the emergency checkpoint's
step (the step rank 0 had reached), the step the restarted roles resumed from (steps lost: the
difference), the newest periodic checkpoint before the notice (steps a crash at that moment
would have lost: back to it), and the seconds from the supervisor acting on the notice to the
first step after the resume. The local cluster keeps its shape; on ``ec2`` a replacement's
launch comes on top.

    .venv/bin/python benchmarks/spot_notice.py [--notice-steps 70,130,190] [--every-n-steps 50] [--json OUT]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.digits import digits_csv  # noqa: E402
from testkit.local_jobs import make_job, shard_digits  # noqa: E402
from testkit.metadata_server import running_metadata_server  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.spot_runs import run_with_notice  # noqa: E402

# Rank 0's steps slowed (the arithmetic untouched), so each notice lands while the job trains.
SLOW_RANK_0 = {"MXPIPE_FAULT_STEP_DELAY_S": "0.05", "MXPIPE_FAULT_KILL_RANK": "0"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--notice-steps", default="70,130,190", help="rank 0's step at each job's notice")
    parser.add_argument("--every-n-steps", type=int, default=50, help="the periodic checkpoint interval")
    parser.add_argument("--copies", type=int, default=4, help="copies of digits in the table (steps per epoch)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    steps = [int(s) for s in args.notice_steps.split(",") if s.strip()]
    runs = []
    with tempfile.TemporaryDirectory(prefix="mxpipe-s1-") as tmp:
        root = Path(tmp)
        cfg, shards = shard_digits(str(root / "data"), digits_csv(args.copies))
        cfg = cfg.replace(optim={"epochs": args.epochs}, checkpoint={"every_n_steps": args.every_n_steps},
                          cluster={"num_workers": 2, "num_servers": 1, "optimizer_on": "workers"})
        with running_metadata_server(str(root / "imds")) as fake:
            for step in steps:
                prefix = str(root / f"notice-{step}")
                outcome = run_with_notice(make_job(cfg, shards, prefix), prefix, root, fake, notice_at_step=step,
                                          env=SLOW_RANK_0)
                runs.append(outcome.as_dict() | {"notice_at_step": step})
                print(runs[-1], flush=True)
    summary = {"every_n_steps": args.every_n_steps, "runs": runs,
               "steps_lost_max": max(r["steps_lost"] for r in runs),
               "crash_steps_lost_mean": statistics.mean(r["steps_lost_by_a_crash"] for r in runs),
               "seconds_to_first_step_median": statistics.median(r["seconds_to_first_step"] for r in runs)}
    print(f"S1: steps lost {summary['steps_lost_max']} (max of {len(runs)}), a crash at the same moments "
          f"{summary['crash_steps_lost_mean']:.1f} (mean); notice → first step after resume "
          f"{summary['seconds_to_first_step_median']:.1f} s (median)")
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
