"""A network of the user's own (``model.name = "package.module:factory"``): the config accepts
and refuses it by syntax, its code is packed and staged by digest and verified when fetched,
every broken factory fails with a message naming it, the shard task refuses it without a retry,
a worker with corrupt code exits with the deterministic code, planning counts it, and its export
loads where neither the project nor the user's folder is importable."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pytest

from common import model_code, storage
from common.config import ConfigError, TrainConfig
from common.model_code import ModelCodeError, StagedCode
from training.loop.custom_model import ModelBuildError
from training.loop.model import build_model, count_model
from testkit.custom_nets import write_package
from testkit.digits import digits_frame
from testkit import REPO

pytestmark = pytest.mark.unit

FEATURES, CLASSES = 64, 10


@pytest.fixture
def code_dir(tmp_path):
    return write_package(str(tmp_path / "user-code"))


def _cfg(name: str, **model) -> TrainConfig:
    return TrainConfig.from_dict({"model": {"name": name, **model}})


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "mynet:build", "my_pkg.sub.arch:make_net2"])
def test_model_name_takes_the_zoo_or_an_import_path(name):
    assert _cfg(name).model.name == name


@pytest.mark.parametrize("name", ["", "vgg", "mynet.arch", "mynet.arch:", ":build", "my-net:build", "a..b:c",
                                  "mynet.arch:build:x", "1net:build", "mynet.arch:build()"])
def test_a_malformed_model_name_is_refused_naming_the_field(name):
    with pytest.raises(ConfigError, match=r"model\.name must be one of .* or an import path 'package\.module:factory'"):
        _cfg(name)


def test_options_are_any_json_object_and_travel_through_the_config_json():
    options = {"width": 16, "blocks": [1, 2.5], "act": "relu", "deep": {"on": True, "none": None}}
    cfg = _cfg("mynet.arch:build", options=options, code_uri="s3://bucket/code/nets/")
    again = TrainConfig.from_json(cfg.to_json())
    assert again.model.options == options and again.digest() == cfg.digest()


@pytest.mark.parametrize("model,message", [
    ({"name": "mynet:build", "options": [1]}, r"model\.options must be a JSON object, got \[1\]"),
    ({"name": "mynet:build", "code_uri": "relative/nets"}, r"model\.code_uri must be an absolute path or an s3://"),
    ({"name": "mlp", "options": {"width": 3}}, r"model\.options and model\.code_uri are for a custom network"),
    ({"name": "lenet", "code_uri": "/src/nets"}, r"model\.options and model\.code_uri are for a custom network"),
])
def test_custom_fields_are_checked(model, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict({"model": model, "data": {"input_shape": [1, 8, 8]}})


def test_a_split_placement_needs_a_zoo_network():
    with pytest.raises(ConfigError, match=r"model\.placement='split' needs a network of the zoo"):
        TrainConfig.from_dict({"model": {"name": "mynet:build", "placement": "split"},
                               "cluster": {"devices_per_worker": 2}})


def test_a_zoo_config_digests_without_the_custom_fields():
    """What its digest hashes, and so its checkpoints' resume digest, are what they were."""
    assert set(TrainConfig().digest_dict()["model"]) == {"name", "hidden", "dropout", "placement"}


# --- packing, staging, fetching ------------------------------------------------------------------

def test_packing_depends_on_the_files_only(code_dir, tmp_path):
    first = model_code.pack(code_dir)
    arch = os.path.join(code_dir, "mynet", "arch.py")
    os.utime(arch, (1, 1))  # another time
    os.makedirs(os.path.join(code_dir, "mynet", "__pycache__"))
    with open(os.path.join(code_dir, "mynet", "__pycache__", "arch.cpython-311.pyc"), "wb") as fh:
        fh.write(b"bytecode")
    assert model_code.pack(code_dir) == first
    with open(arch, "a") as fh:
        fh.write("# changed\n")
    assert model_code.pack(code_dir) != first


def test_staged_code_is_fetched_verified_and_put_on_the_path(code_dir, tmp_path):
    staged = model_code.stage(code_dir, str(tmp_path / "run" / "code"))
    assert staged.uri.endswith("/code/model_code.tar.gz")
    assert staged.sha256 == storage.sha256_bytes(storage.get_bytes(staged.uri))
    with model_code.on_path(staged) as folder:
        arch = importlib.import_module("mynet.arch")  # only importable from the staged copy
        assert arch.__file__ == os.path.join(folder, "mynet", "arch.py")
    assert "mynet.arch" not in sys.modules and folder not in sys.path and not os.path.exists(folder)


def test_a_single_module_file_is_code_too(tmp_path):
    (tmp_path / "tiny.py").write_text("def build(num_outputs, input_shape, options):\n"
                                      "    from mxnet.gluon import nn\n    return nn.Dense(num_outputs)\n")
    with model_code.on_path(str(tmp_path / "tiny.py")):
        net = build_model(_cfg("tiny:build"), CLASSES, FEATURES)
    assert net.__class__.__name__ == "Dense"


def test_a_changed_archive_fails_its_digest(code_dir, tmp_path):
    staged = model_code.stage(code_dir, str(tmp_path / "code"))
    storage.put_bytes(staged.uri, model_code.pack(write_package(str(tmp_path / "other"))) + b"\0")
    with pytest.raises(ModelCodeError, match=r"has sha256 \w+, not the \w+ staged for this run"):
        model_code.fetch(staged, str(tmp_path / "into"))


@pytest.mark.parametrize("source,message", [("/nonexistent/nets", "no such folder"),
                                            ("/nonexistent/net.py", "no such file")])
def test_missing_code_is_named(source, message):
    with pytest.raises(ModelCodeError, match=rf"model\.code_uri {source}: {message}"):
        model_code.pack(source)


# --- building and checking ----------------------------------------------------------------------

@pytest.mark.parametrize("factory,message", [
    ("mynet.nothere:build", r"no module named 'mynet\.nothere'"),
    ("othernet.arch:build", r"no module named 'othernet'"),
    ("mynet.broken:build", r"importing mynet\.broken failed: ImportError: needs torch"),
    ("mynet.arch:nope", r"module mynet\.arch \(.*arch\.py\) has no callable 'nope'"),
    ("mynet.arch:NOT_A_FACTORY", r"has no callable 'NOT_A_FACTORY'"),
    ("mynet.arch:raises", r"the factory raised RuntimeError: no such width: 7"),
    ("mynet.arch:not_hybrid", r"the factory returned Sequential, not a mxnet\.gluon\.HybridBlock"),
    ("mynet.arch:not_traceable", r"cannot be traced as a symbol on an input \[batch, 64\]"),
    ("mynet.arch:wrong_size", r"output for a batch of 2 is \[2, 11\], expected \[2, 10\]"),
])
def test_every_broken_factory_is_named(code_dir, factory, message):
    with model_code.on_path(code_dir), pytest.raises(ModelBuildError, match=rf"model\.name='{factory}': .*{message}"):
        build_model(_cfg(factory, options={"width": 7}), CLASSES, FEATURES)


def test_a_model_build_error_is_a_config_error():
    """What the shard task turns into AirflowFailException and a worker into EXIT_BAD_INPUT."""
    assert issubclass(ModelBuildError, ConfigError) and issubclass(ModelCodeError, ConfigError)


def test_the_factory_gets_the_image_shape_and_the_flat_records_are_reshaped(code_dir):
    mx = pytest.importorskip("mxnet")
    cfg = TrainConfig.from_dict({"model": {"name": "mynet.arch:conv"}, "data": {"input_shape": [1, 8, 8]}})
    with model_code.on_path(code_dir):
        net = build_model(cfg, CLASSES, FEATURES)
    net.initialize()
    assert net(mx.nd.zeros((3, FEATURES))).shape == (3, CLASSES)


def test_planning_counts_a_custom_network_like_the_zoos(code_dir):
    """mynet.arch:build at width w is Residual(w) + Dense(classes): two w-wide Dense layers side
    by side on the input, then the output layer."""
    with model_code.on_path(code_dir):
        counted = count_model("mynet.arch:build", (FEATURES,), CLASSES, options={"width": 16})
    assert counted["params"] == 2 * (FEATURES * 16 + 16) + (16 * CLASSES + CLASSES)
    assert counted["activations_per_sample"] > 0


def test_the_planning_cli_takes_a_custom_network_and_its_code(code_dir):
    out = subprocess.run([sys.executable, "scripts/plan.py", "--model", "mynet.arch:build", "--model-code", code_dir,
                          "--model-options", '{"width": 16}', "--input-shape", "64", "--classes", "10", "--json"],
                         capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params"] == 2 * (FEATURES * 16 + 16) + (16 * CLASSES + CLASSES)


def test_the_export_loads_without_the_users_code_or_the_project(code_dir, tmp_path):
    """The registered model is the exported symbol + params (training.tracking.pyfunc_model): a
    block of the user's own class needs nothing of theirs to load, only mxnet."""
    mx = pytest.importorskip("mxnet")
    with model_code.on_path(code_dir):
        net = build_model(_cfg("mynet.arch:build", options={"width": 8}), CLASSES, FEATURES)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = np.random.default_rng(0).random((5, FEATURES), dtype=np.float32)
    expected = net(mx.nd.array(x)).asnumpy()
    os.makedirs(tmp_path / "export")
    net.export(str(tmp_path / "export" / "model"), epoch=0)
    np.save(tmp_path / "x.npy", x)
    load = ("import sys, numpy as np, mxnet as mx\n"
            "assert not {sys.argv[2], sys.argv[3]} & set(sys.path), sys.path\n"
            "for name in ('mynet', 'training', 'common'):\n"
            "    try:\n        __import__(name)\n    except ImportError:\n        pass\n"
            "    else:\n        raise SystemExit(name + ' is importable')\n"
            "net = mx.gluon.SymbolBlock.imports('export/model-symbol.json', ['data'], 'export/model-0000.params')\n"
            "np.save('y.npy', net(mx.nd.array(np.load('x.npy'))).asnumpy())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", load, "-", REPO, code_dir], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, rtol=1e-5, atol=1e-6)


# --- the shard task and a worker ------------------------------------------------------------------

@pytest.fixture
def tasks(tmp_path, monkeypatch):
    pytest.importorskip("airflow.sdk")
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    from plugins import pipeline_tasks

    return pipeline_tasks


@pytest.fixture
def digits_uri(tmp_path):
    digits_frame().to_csv(tmp_path / "digits.csv", index=False)
    return str(tmp_path / "digits.csv")


def _params(dataset_uri: str, **model) -> dict:
    return {"dataset_uri": dataset_uri, "label_column": "label", "recipe": "debug", "model": "mlp",
            "num_workers": 2, "num_servers": 1, "registered_model_name": "m", "config": {"model": model}}


def test_the_shard_task_stages_the_code_and_checks_the_network(tasks, digits_uri, code_dir, tmp_path):
    config, shards = tasks.shard_in_process(_params(digits_uri, name="mynet.arch:build", code_uri=code_dir), "dag", "run-ok")
    staged = shards["model_code"]
    assert staged["uri"] == str(tmp_path / "artifacts" / "dag" / "run-ok" / "code" / "model_code.tar.gz")
    assert staged["sha256"] == storage.sha256_bytes(model_code.pack(code_dir))
    assert config["model"]["code_uri"] == code_dir and "mynet" not in sys.modules


@pytest.mark.parametrize("model,message,sharded", [
    ({"name": "mynet.nothere:build"}, r"no module named 'mynet\.nothere'", False),
    ({"name": "mynet.arch:raises"}, r"the factory raised RuntimeError", True),
    ({"name": "mynet.arch:wrong_size"}, r"output for a batch of 2 is \[2, 11\], expected \[2, 10\]", True),
    ({"name": "mynet.arch:build", "code_uri": "/nonexistent/nets"}, r"model\.code_uri /nonexistent/nets: no such", False),
])
def test_the_shard_task_refuses_a_broken_network_without_retry(tasks, digits_uri, code_dir, tmp_path, model, message,
                                                               sharded):
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=rf"invalid model: .*{message}"):
        tasks.shard_in_process(_params(digits_uri, **{"code_uri": code_dir, **model}), "dag", "run-bad")
    # A bad import path or code location fails before the source is read; a factory only after
    # the shards tell it its number of classes and features.
    assert os.path.isdir(tmp_path / "artifacts" / "datasets") == sharded


def test_a_worker_with_corrupt_code_exits_with_the_deterministic_code(code_dir, tmp_path, caplog):
    from training.__main__ import _worker
    from common.events import DETERMINISTIC_EXIT_CODES, EXIT_BAD_INPUT
    from training.launch.job import JobSpec

    staged = model_code.stage(code_dir, str(tmp_path / "code"))
    job = JobSpec(config=_cfg("mynet.arch:build", code_uri=code_dir), shards_prefix=str(tmp_path / "shards"),
                  checkpoint_prefix=str(tmp_path / "ckpt"), model_prefix=str(tmp_path / "model"),
                  metrics_uri=str(tmp_path / "metrics.json"), model_code_uri=staged.uri,
                  model_code_sha256="0" * 64)
    job.save(str(tmp_path / "job.json"))
    assert _worker(str(tmp_path / "job.json")) == EXIT_BAD_INPUT in DETERMINISTIC_EXIT_CODES
    assert "staged for this run: it was changed or corrupted" in caplog.text
    assert StagedCode(staged.uri, staged.sha256) == staged


def test_the_trigger_form_refuses_a_malformed_import_path_and_keeps_the_zoo_shortcut():
    pytest.importorskip("airflow.sdk")
    from airflow.sdk.definitions.param import ParamValidationError
    from plugins.params import training_params

    form = training_params()
    good = {"model": {"name": "mynet.arch:build", "code_uri": "s3://bucket/nets/", "options": {"w": [1, {"x": None}]}}}
    assert form["config"].resolve(good) == good
    for bad in ({"model": {"name": "my-net.arch:build"}}, {"model": {"name": "mynet.arch"}},
                {"model": {"name": "mynet.arch:build", "code_uri": "nets/"}}, {"model": {"options": 3}}):
        with pytest.raises(ParamValidationError):
            form["config"].resolve(bad)
    with pytest.raises(ParamValidationError):  # the shortcut offers the zoo; a custom network goes in config
        form["model"].resolve("mynet.arch:build")


def test_a_checkpoint_of_other_network_code_is_not_resumed():
    """The code's digest is part of what a checkpoint was trained with: the same model.code_uri
    holding changed code must not resume the old parameters."""
    from training.launch.job import JobSpec
    from training.loop.resume import check_compatible, train_record, TrainState

    cfg = _cfg("mynet.arch:build", code_uri="/opt/nets")
    manifest = {"shards": [], "num_features": 4}
    state = train_record(TrainState(), [], cfg, 2, manifest, code_sha256="a" * 64)
    job = JobSpec(config=cfg, shards_prefix="s", checkpoint_prefix="c", model_prefix="m", metrics_uri="x",
                  model_code_uri="s3://b/code.tar.gz", model_code_sha256="a" * 64)
    check_compatible(state, job, 2, manifest)
    with pytest.raises(ValueError, match="network's code changed"):
        check_compatible(state, dataclasses.replace(job, model_code_sha256="b" * 64), 2, manifest)
