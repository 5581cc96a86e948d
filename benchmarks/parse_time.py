"""P7, DAG parse time: seconds to import each DAG file in a fresh interpreter once the Airflow
modules it imports are loaded (as a DAG processor has them), and which heavy modules the file
pulled in. Median of N runs per file.

    .venv/bin/python benchmarks/parse_time.py [N] [--json OUT]
"""
from __future__ import annotations

import ast
import glob
import json
import os
import statistics
import subprocess
import sys

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit import REPO  # noqa: E402
from testkit.result_file import write_json  # noqa: E402

DAG_FILES = sorted(glob.glob(os.path.join(REPO, "dags", "*.py")))
HEAVY = ("mxnet", "mlflow", "great_expectations", "pandas", "boto3", "sklearn")

SNIPPET = """
import importlib, importlib.util, json, sys, time
for name in {preload!r}:
    importlib.import_module(name)
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("dagfile", {path!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(json.dumps({{"seconds": time.perf_counter() - t, "heavy": [h for h in {heavy!r} if h in sys.modules]}}))
"""


def airflow_imports(path: str) -> list[str]:
    """The Airflow modules a DAG file imports (loaded before the clock starts)."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "airflow":
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "airflow")
    return sorted(names)


def measure_file(path: str, runs: int) -> dict:
    code = SNIPPET.format(preload=airflow_imports(path), path=path, heavy=HEAVY)
    samples, heavy = [], set()
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        samples.append(result["seconds"])
        heavy.update(result["heavy"])
    return {"median_s": statistics.median(samples), "max_s": max(samples), "heavy": sorted(heavy)}


def measure(runs: int = 5) -> dict:
    files = {os.path.basename(p): measure_file(p, runs) for p in DAG_FILES}
    return {"runs": runs, "files": files, "worst_median_s": max(f["median_s"] for f in files.values()),
            "heavy": sorted({h for f in files.values() for h in f["heavy"]})}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="?", type=int, default=5)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    result = measure(args.runs)
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
