"""F1-F5: issue 27's faults on the namespace topology (``infra.topology``: PostgreSQL, Redis,
SeaweedFS, MLflow, Airflow with the CeleryExecutor on two worker hosts and a triggerer host,
three sshd training hosts), each in a training DAG run on digits with the ``hosts`` backend.

The topology comes up once; an uninterrupted baseline runs first, then one run per fault
(``testkit.topology_faults.FAULTS``), each with the same config and seed. For each run: its
end state, the tasks that were retried, the recovery time (the fault injected → the run back on
track: the killed task's retry succeeded, the trigger taken up by the restarted triggerer,
Airflow healthy again, the next checkpoint committed), the seconds it took against the
baseline's, and whether its final parameters (the last checkpoint's arrays and the registered
model's parameter file, by sha256) equal the baseline's. The topology is brought down at the
end, whatever happened (``down`` fails if anything is left).

Needs root and the topology's Debian packages; takes the machine. Another session may use the
topology (one prefix, one set of namespaces): run it under a lock they take too,

    flock <lock file> .venv/bin/python benchmarks/topology_faults.py \\
        [--faults worker_shard,triggerer,...] [--json benchmarks/topology_faults.json] [--keep-logs DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra.topology import HOSTS, TopologySettings, down, host_records, up  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.topology_faults import FAULTS, fault_run, same_params  # noqa: E402
from testkit.topology_runs import leftovers  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "topology_faults.json")


def run(faults: list[str], json_path: str | None, keep_logs: str | None = None) -> dict[str, Any]:
    from testkit.digits import digits_csv

    csv = digits_csv()
    settings = TopologySettings()
    # Not a mode-0700 temp folder: PostgreSQL's own user must enter it (as the test tier's).
    root = Path(tempfile.mkdtemp(prefix="mxpipe-topology-faults-"))
    root.chmod(0o755)
    result: dict[str, Any] = {"settings": {"task_heartbeat_timeout_s": settings.task_heartbeat_timeout_s,
                                           "retry_delay_s": settings.retry_delay_s}, "runs": []}
    t0 = time.monotonic()
    try:
        up(root, settings)
        result["up_s"] = round(time.monotonic() - t0, 1)
        baseline = fault_run(root, csv, "baseline")
        result["baseline"] = baseline
        write_json(json_path, result)
        for fault in faults:
            outcome = fault_run(root, csv, fault, fault)
            outcome["same_params_as_baseline"] = same_params(outcome, baseline)
            outcome["added_s"] = round(outcome["seconds"] - baseline["seconds"], 1)
            result["runs"].append(outcome)
            write_json(json_path, result)  # every run kept, should a later one break the topology
    finally:
        result["down_ok"] = down(root)
        if keep_logs:  # every host's server logs, for a look after the topology is gone
            for host in HOSTS:
                if (host_records(root, host) / "logs").is_dir():
                    shutil.copytree(host_records(root, host) / "logs", Path(keep_logs) / host, dirs_exist_ok=True)
        result["left"] = leftovers(settings)
        shutil.rmtree(root, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - t0, 1)
    result["summary"] = {r["fault"]: {"state": r["state"], "recovery_s": (r["measured"] or {}).get("recovery_s"),
                                      "run_s": r["seconds"], "added_s": r["added_s"],
                                      "same_params": r["same_params_as_baseline"], "error": r["error"]}
                         for r in result["runs"]}
    write_json(json_path, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {list(FAULTS)}")
    parser.add_argument("--json", default=DEFAULT_JSON)
    parser.add_argument("--keep-logs", help="copy every host's server logs into this folder at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}")
    result = run(faults, args.json, args.keep_logs)
    print(json.dumps({"baseline_s": result["baseline"]["seconds"], "summary": result["summary"],
                      "down_ok": result["down_ok"]}, indent=2))
    ok = result["down_ok"] and result["baseline"]["state"] == "success" and all(
        r["state"] == "success" and r["same_params_as_baseline"] for r in result["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
