"""DAG parse time: seconds to import the DAG file in a fresh interpreter once Airflow's SDK
(and the SDK names the file uses) are loaded, as a DAG processor has them. Median of N runs.

    .venv/bin/python benchmarks/parse_time.py [N]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAG_FILE = os.path.join(REPO, "dags", "mxnet_training.py")
HEAVY = ("mxnet", "mlflow", "great_expectations", "pandas", "boto3", "sklearn")

SNIPPET = f"""
import importlib.util, json, sys, time
from airflow.sdk import CronTriggerTimetable, Param, dag, get_current_context, setup, task, teardown
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("dagfile", {DAG_FILE!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(json.dumps({{"seconds": time.perf_counter() - t, "heavy": [h for h in {HEAVY!r} if h in sys.modules]}}))
"""


def measure(runs: int = 5) -> dict:
    samples, heavy = [], set()
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=120,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        samples.append(result["seconds"])
        heavy.update(result["heavy"])
    return {"median_s": statistics.median(samples), "max_s": max(samples), "runs": runs, "heavy": sorted(heavy)}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 5), indent=2))
