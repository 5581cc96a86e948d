"""The command lines as a person meets them: --help with examples, bad input as one line with
exit status 2, a recipe printed as a config file, and a validation log free of library chatter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from common.config import TrainConfig, recipe
from testkit import REPO

pytestmark = pytest.mark.unit

CLIS = [("-m", "training"), ("-m", "data_checks"), ("-m", "infra.services"), ("-m", "infra"),
        ("-m", "infra.planning"), ("-m", "infra.cluster"), ("-m", "common.procs"), ("scripts/plan.py",),
        ("scripts/demo.py",)]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO})


def _usage_error(out: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a usage error (exit status 2, no traceback)."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.mark.parametrize("cli", CLIS, ids=lambda c: c[-1])
def test_help_has_a_description_and_examples(cli):
    out = _run(*cli, "--help")
    assert out.returncode == 0, out.stderr
    description = out.stdout.split("\n\n")[1]
    assert not description.startswith(("positional arguments", "options")), out.stdout
    examples = out.stdout.split("\nexamples:\n")[1]
    assert cli[-1] in examples, out.stdout


@pytest.mark.parametrize("command", [("training", "run", "--shards", "s", "--out", "o"),
                                     ("data_checks", "shard", "--out", "o"),
                                     ("data_checks", "validate", "--shards", "s")], ids=" ".join)
def test_a_missing_or_bad_config_file_is_one_line(tmp_path, command):
    missing = tmp_path / "missing.json"
    assert _usage_error(_run("-m", *command, "--config", str(missing))) == f"error: config file not found: {missing}"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cluster": {"num_workers": 0}}))
    line = _usage_error(_run("-m", *command, "--config", str(bad)))
    assert line == f"error: config file {bad}: cluster.num_workers must be in [1, 256], got 0"
    bad.write_text('{"optim": {"epochs": 3,}}')
    assert "is not valid JSON" in _usage_error(_run("-m", *command, "--config", str(bad)))
    bad.write_text(json.dumps({"optim": 3}))
    assert "config section 'optim' must be a JSON object" in _usage_error(_run("-m", *command, "--config", str(bad)))


@pytest.mark.parametrize("flags,problem", [
    (("--model", "resnet51"), "--model must be one of mlp, lenet, resnet18, resnet50, got 'resnet51'"),
    (("--model", "lenet", "--input-shape", "1,x,28"), "--input-shape must be positive integers"),
    (("--model", "lenet", "--input-shape", "784"), "model.name='lenet' needs data.input_shape"),
    (("--params", "nan"), "--params must be a finite count >= 1, got nan"),
    (("--params", "1e6", "--batch-size", "0"), "--batch-size must be >= 1, got 0"),
])
def test_plan_with_an_unknown_model_or_bad_numbers_is_one_line(flags, problem):
    assert problem in _usage_error(_run("scripts/plan.py", *flags))


@pytest.mark.parametrize("name", ["digits", "debug"])
def test_a_printed_recipe_loads_back_as_the_same_config(tmp_path, name):
    out = _run("-m", "training", "config", "--recipe", name, "--dataset", "s3://b/data.csv")
    assert out.returncode == 0 and not out.stderr, out.stderr
    (tmp_path / "cfg.json").write_text(out.stdout)
    assert TrainConfig.from_file(str(tmp_path / "cfg.json")) == recipe(name, "s3://b/data.csv")
    assert json.loads(out.stdout)["data"]["source_uri"] == "s3://b/data.csv"


def test_an_unknown_recipe_is_one_line():
    assert "unknown recipe 'tiny'" in _usage_error(_run("-m", "training", "config", "--recipe", "tiny"))


def test_the_validation_log_tells_only_the_pipeline_story(tmp_path):
    """Great Expectations logs ~260 INFO lines per validation ("Skipping registering function …"
    from its public-API decorator at import, then per context and expectation); none reach the log."""
    rows = ["f0,f1,label"] + [f"{i % 7}.5,{i % 5},{i % 3}" for i in range(120)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    cfg = {"data": {"source_uri": str(tmp_path / "t.csv"), "label_column": "label"},
           "cluster": {"num_workers": 1, "num_servers": 1}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    shard = _run("-m", "data_checks", "shard", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "s"))
    assert shard.returncode == 0, shard.stderr
    out = _run("-m", "data_checks", "validate", "--config", str(tmp_path / "cfg.json"), "--shards",
               str(tmp_path / "s"), "--docs", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Skipping registering function" not in out.stderr
    assert all(re.match(r"(INFO|WARNING) data_checks\.", line) for line in out.stderr.splitlines()), out.stderr
    assert json.loads(out.stdout)["success"] is True


def test_shard_in_parts_from_the_command_line_gives_the_shards_of_one_pass(tmp_path):
    rows = ["f0,f1,label"] + [f"{i % 7}.5,{i % 5},{i % 3}" for i in range(120)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    cfg = {"data": {"source_uri": str(tmp_path / "t.csv"), "label_column": "label"},
           "cluster": {"num_workers": 1, "num_servers": 1}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    args = ("-m", "data_checks", "shard", "--config", str(tmp_path / "cfg.json"), "--under", str(tmp_path / "s"))
    parted = _run(*args, "--parts", "2")
    assert parted.returncode == 0, parted.stderr
    assert "in 2 part(s)" in parted.stderr
    again = _run(*args)  # one pass finds the shards of the parts: same fingerprint, same prefix
    assert again.returncode == 0, again.stderr
    first, second = json.loads(parted.stdout), json.loads(again.stdout)
    assert not first["reused"] and second["reused"] and second["shards"] == first["shards"]
    refused = _run("-m", "data_checks", "shard", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "o"),
                   "--parts", "2")
    assert refused.returncode == 2 and "--parts needs --under" in refused.stderr
