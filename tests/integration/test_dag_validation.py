"""Bad data stops the DAG at validation: nothing is provisioned or trained.

A whole ``dag.test()`` run (the real task runner, dynamic task mapping, trigger rules) against
a real SeaweedFS S3 server. The source has non-finite features (caught by the per-shard GX
suites, in some mapped tasks) and duplicate ids (caught only by the cross-shard task).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from common import storage

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUNNER = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(sys.argv[1])
assert not bag.import_errors, bag.import_errors
dag = bag.dags["mxnet_training"]
dr = dag.test(run_conf=json.loads(sys.argv[2]))
tis = [{"task_id": ti.task_id, "map_index": ti.map_index, "name": ti.rendered_map_index, "state": str(ti.state),
        "try_number": ti.try_number} for ti in dr.get_task_instances()]
print("DAGRUN_RESULT " + json.dumps({"state": str(dr.state), "run_id": dr.run_id, "tasks": tis}))
"""


@pytest.fixture(scope="module")
def airflow_env(s3_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("mxpipe-home")
    env = {
        **os.environ,
        "MXPIPE_HOME": str(home),
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(REPO, "dags"),
        "PYTHONPATH": REPO,
        "MXPIPE_ARTIFACT_ROOT": f"s3://{s3_server.bucket}/dag-validation",
        "MXPIPE_SCHEDULE": "none",
        "MXPIPE_RETRY_DELAY_S": "1",
    }
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"], env=env,
                   check=True, capture_output=True, timeout=300)
    return env


def test_bad_data_fails_validation_and_nothing_downstream_runs(airflow_env, s3_server, digits_csv):
    import io

    frame = pd.read_csv(io.BytesIO(digits_csv))
    frame.insert(0, "uid", [f"u{i}" for i in range(len(frame))])
    frame.loc[[10, 700], "pixel_5"] = np.nan
    frame.loc[1200, "uid"] = "u3"
    uri = f"s3://{s3_server.bucket}/datasets/bad-digits.csv"
    storage.put_bytes(uri, frame.to_csv(index=False).encode())
    conf = {"dataset_uri": uri, "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 2,
            "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
            "kvstore": "dist_sync", "checkpoint_every_n_steps": 10, "registered_model_name": "never",
            "data_options": {"id_column": "uid"}}
    out = subprocess.run([sys.executable, "-c", RUNNER, os.path.join(REPO, "dags"), json.dumps(conf)],
                         env=airflow_env, capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DAGRUN_RESULT ")]
    assert lines, f"no result (rc={out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    result, logs = json.loads(lines[-1][len("DAGRUN_RESULT "):]), out.stdout + out.stderr

    states = {(t["task_id"], t["name"] or t["map_index"]): t for t in result["tasks"]}
    assert result["state"] == "failed"
    assert states[("shard", -1)]["state"] == "success"
    mapped = {name: t["state"] for (task, name), t in states.items() if task == "validate_shard"}
    assert set(mapped) == {"train-00000", "train-00001", "val", "test"}, mapped  # one task per shard, by name
    assert "failed" in mapped.values() and "success" in mapped.values(), mapped  # NaN rows are in some shards
    assert all(t["try_number"] == 1 for (task, _), t in states.items() if task == "validate_shard")  # no retry
    assert states[("validate", -1)]["state"] == "failed" and states[("validate", -1)]["try_number"] == 1
    for task in ("provision", "train", "register"):
        assert states[(task, -1)]["state"] in ("upstream_failed", "None", "skipped"), (task, states[(task, -1)])
    assert "every feature is finite" in logs and "pixel_5" in logs
    assert "ids_unique_across_shards" in logs and "source rows [3, 1200]" in logs

    root = f"s3://{s3_server.bucket}/dag-validation"
    written = list(storage.list_uris(root))
    report_uri = next(u for u in written if u.endswith("/validation/validation.json"))
    report = json.loads(storage.get_bytes(report_uri))
    assert report["success"] is False and {f["expectation"] for f in report["failures"]} >= {
        "expect_column_values_to_be_null", "ids_unique_across_shards"}
    assert any(u.endswith("/validation/validation.html") for u in written)
    assert any(u.endswith("/validation/shards/val.html") for u in written)  # GX Data Docs page
    assert not any(u.endswith("latest_validated.json") for u in written)
    assert not any("/checkpoints/" in u for u in written)
