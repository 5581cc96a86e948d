"""The pipeline without Airflow: the documented command lines, on local folders."""
import json
import os
import subprocess
import sys

import pytest

from testkit import REPO

pytestmark = pytest.mark.integration


def _cli(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


def test_shard_validate_train_from_the_command_line(tmp_path, digits_csv):
    (tmp_path / "digits.csv").write_bytes(digits_csv)
    cfg = {"data": {"source_uri": str(tmp_path / "digits.csv"), "label_column": "label"},
           "optim": {"epochs": 3, "batch_size": 32, "learning_rate": 0.005},
           "cluster": {"num_workers": 2, "num_servers": 1}, "checkpoint": {"every_n_steps": 10}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))

    out = _cli("data_checks", "shard", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "shards"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["splits"]["train"]["count"] > 1000

    out = _cli("data_checks", "validate", "--config", str(tmp_path / "cfg.json"), "--shards", str(tmp_path / "shards"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["success"] is True
    assert "Skipping registering function" not in out.stderr  # Great Expectations' INFO chatter stays out

    out = _cli("training", "run", "--config", str(tmp_path / "cfg.json"), "--shards", str(tmp_path / "shards"),
               "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{\n"):])
    assert result["final"]["epoch"] == 2 and result["final"]["val_accuracy"] > 0.85
    assert sorted(os.listdir(tmp_path / "run" / "model")) == ["model-0000.params", "model-symbol.json",
                                                               "model_meta.json", "preprocessing.json"]


def test_bad_config_is_a_clear_error(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"cluster": {"num_workers": 0}}))
    out = _cli("data_checks", "shard", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "s"))
    assert out.returncode == 2  # argparse's status for a usage error; a failed check exits 1
    assert "cluster.num_workers must be in [1, 256], got 0" in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr
