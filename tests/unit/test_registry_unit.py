"""Param flattening, limits, batching and retry bookkeeping of training.tracking.registry and
training.tracking.mlflow_params (no server)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from training.tracking import mlflow_params
from training.tracking import registry, runs
from training.tracking.mlflow_params import (
    ParamConflictError,
    chunked,
    flatten_params,
    metric_points,
    params_to_log,
    truncate_value,
)
from training.tracking.runs import bounded_mlflow_env, run_url
from testkit import REPO

pytestmark = pytest.mark.unit


def test_flatten_nested_dicts_with_dotted_keys_and_string_values():
    flat = flatten_params(
        {"lr": 0.002, "model": {"name": "mlp", "hidden": (128, 64), "opt": {"wd": 0.0}}, "seed": None, "on": True}
    )
    assert flat == {
        "lr": "0.002",
        "model.name": "mlp",
        "model.hidden": "[128, 64]",
        "model.opt.wd": "0.0",
        "seed": "None",
        "on": "True",
    }


def test_flatten_accepts_dataclasses():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        a: int = 1

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner = Inner()
        b: str = "x"

    assert flatten_params({"cfg": Outer()}) == {"cfg.inner.a": "1", "cfg.b": "x"}


def test_flatten_rejects_keys_that_collide_after_flattening():
    with pytest.raises(ValueError, match="duplicate keys"):
        flatten_params({"a.b": 1, "a": {"b": 2}})


@pytest.mark.parametrize("key", ["bad$key", "../up", "/abs", "a//b", "x" * 251])
def test_flatten_rejects_keys_mlflow_would_refuse(key):
    with pytest.raises(ValueError, match="invalid MLflow param keys"):
        flatten_params({key: 1})


def test_long_values_are_truncated_deterministically_within_the_limit():
    long = "v" * 5000
    out = flatten_params({"k": long})["k"]
    assert len(out) == mlflow_params.MAX_PARAM_VALUE_LENGTH
    assert "truncated, sha256:" in out
    assert out == truncate_value(long)  # the same on a retry
    assert truncate_value("v" * 4999) != out  # different values stay different
    assert truncate_value("short") == "short"


def test_chunked_respects_mlflow_batch_limits():
    params = [(f"p{i}", "v") for i in range(250)]
    batches = chunked(params, mlflow_params.MAX_PARAMS_PER_BATCH)
    assert [len(b) for b in batches] == [100, 100, 50]
    assert [x for b in batches for x in b] == params
    assert [len(b) for b in chunked(list(range(2001)), mlflow_params.MAX_METRICS_PER_BATCH)] == [1000, 1000, 1]
    assert chunked([], 100) == []
    with pytest.raises(ValueError):
        chunked([1], 0)


def test_params_to_log_skips_same_values_and_reports_every_conflict():
    existing = {"a": "1", "b": "x", "c": "3"}
    assert params_to_log(existing, {"a": "1", "d": "4"}) == {"d": "4"}
    with pytest.raises(ParamConflictError) as err:
        params_to_log(existing, {"a": "2", "b": "y", "d": "4"})
    msg = str(err.value)
    assert "2 param(s)" in msg and "immutable" in msg
    assert "a: logged '1', now '2'" in msg and "b: logged 'x', now 'y'" in msg
    assert isinstance(err.value, ValueError)  # deterministic: no Airflow retry


def test_metric_points_use_epoch_as_step_and_log_finals_at_the_last_step():
    points, final_step = metric_points(
        [{"epoch": 1, "loss": 0.9, "acc": 0.5}, {"epoch": 2, "loss": 0.4, "acc": 0.8}],
        {"test_accuracy": 0.77},
    )
    assert final_step == 2
    assert ("loss", 0.9, 1) in points and ("acc", 0.8, 2) in points
    assert ("test_accuracy", 0.77, 2) in points
    assert not [p for p in points if p[0] == "epoch"]


def test_metric_points_log_a_repeated_point_once_with_the_later_value():
    points, _ = metric_points([{"epoch": 0, "global_step": 10}, {"epoch": 1, "global_step": 20}], {"global_step": 21})
    assert sorted(points, key=lambda p: p[2]) == [("global_step", 10.0, 0), ("global_step", 21.0, 1)]


def test_metric_points_fall_back_to_list_position():
    points, final_step = metric_points([{"loss": 1.0}, {"loss": 0.5}], {})
    assert points == [("loss", 1.0, 0), ("loss", 0.5, 1)]
    assert final_step == 1
    assert metric_points([], {"acc": 1})[1] == 0


def test_metric_points_reject_bad_names():
    with pytest.raises(ValueError, match="invalid MLflow metric names"):
        metric_points([{"bad!": 1.0}], {})


def test_run_url():
    assert run_url("http://127.0.0.1:5000/", "3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc"


def test_pinned_requirements_are_exact_and_match_mxnet_constraints():
    reqs = dict(r.split("==") for r in registry.pinned_requirements())
    assert set(reqs) == {"mlflow", "mxnet", "numpy", "pandas"}
    assert reqs["mxnet"] == "1.9.1"
    assert tuple(int(x) for x in reqs["numpy"].split(".")[:2]) < (1, 24)


def test_bounded_http_sets_defaults_keeps_explicit_env_and_restores(monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    with bounded_mlflow_env():
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == runs.MLFLOW_ENV_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
    with bounded_mlflow_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"


def test_worst_case_http_time_is_well_under_two_minutes():
    d = runs.MLFLOW_ENV_DEFAULTS
    retries, timeout = int(d["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]), float(d["MLFLOW_HTTP_REQUEST_TIMEOUT"])
    factor, jitter = float(d["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]), float(d["MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"])
    # urllib3 2.x: no sleep before the first retry, then factor * 2**(n-1) (+ jitter).
    backoff = sum(factor * 2 ** (n - 1) + jitter for n in range(2, retries + 1))
    assert (retries + 1) * timeout + backoff < 90


def test_registry_and_pyfunc_modules_do_not_import_mxnet():
    # registry (and the helpers it imports), evaluation: stdlib only at import time;
    # pyfunc_model: mlflow (it subclasses PythonModel), never mxnet.
    code = ("import sys, training.tracking.registry, training.tracking.evaluation; "
            "assert not {'mlflow', 'mxnet', 'numpy'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO)
    code = "import sys, training.tracking.pyfunc_model; assert 'mxnet' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180, cwd=REPO)


def test_logged_model_id_of_a_version():
    def version(model_id, source):
        return SimpleNamespace(model_id=model_id, source=source)

    assert registry.logged_model_id(version("m-1", "models:/m-1")) == "m-1"
    assert registry.logged_model_id(version(None, "models:/m-2")) == "m-2"  # the open-source store's source
    assert registry.logged_model_id(version(None, "s3://b/1/artifacts/model")) is None  # before MLflow 3
    assert registry.logged_model_id(version(None, "models:/name/3")) is None  # a version, not a model


@pytest.mark.parametrize("env", [None, "http://127.0.0.1:9/from-the-environment"])
def test_tracking_uri_context_leaves_the_environment_and_fluent_uri_as_found(monkeypatch, env):
    """mlflow.set_tracking_uri also writes MLFLOW_TRACKING_URI; the context puts it back (or
    removes it again) and the fluent API resolves the same URI as before."""
    import mlflow

    if env is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
    before = mlflow.get_tracking_uri()
    with runs.fluent_tracking_uri("http://127.0.0.1:9/inside"):
        assert mlflow.get_tracking_uri() == "http://127.0.0.1:9/inside"
    assert os.environ.get("MLFLOW_TRACKING_URI") == env
    assert mlflow.get_tracking_uri() == before
