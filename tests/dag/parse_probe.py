"""Import one DAG file in a fresh interpreter (after ``airflow.sdk``) and report which heavy
packages it pulled in and how long it took: the parse-time policy every DAG file is held to."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from testkit import REPO

HEAVY = ("mxnet", "mlflow", "great_expectations", "pandas", "boto3", "sklearn", "s3fs", "matplotlib")


def parse_in_fresh_process(dag_file: str, timeout_s: float = 120) -> dict:
    """``{"heavy": [...], "seconds": float}`` for ``dags/<dag_file>``."""
    code = (
        "import sys, time, json, importlib.util\n"
        "import airflow.sdk\n"
        "t = time.monotonic()\n"
        f"spec = importlib.util.spec_from_file_location('dagfile', {os.path.join(REPO, 'dags', dag_file)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(json.dumps({{'heavy': [h for h in {HEAVY!r} if h in sys.modules], "
        "'seconds': time.monotonic() - t}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
