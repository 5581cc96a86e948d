"""Log a trained model to MLflow and register it as the ``challenger``.

``log_model_run`` is what the pipeline's register step calls (on rank 0 or in an Airflow task).
It is safe to retry: given the ``run_id`` of an earlier attempt it reuses that run, skips params
and metric points that are already there, reuses a model version already registered from the
same run with the same model bytes, and the test metrics already linked to that version's model.
MLflow params are immutable, so a retry that brings a *different* value for a logged key fails
at once with ``ParamConflictError`` (deterministic: not worth an Airflow retry) instead of the
server's generic 400. What is sent (flattened params, metric points, batch sizes) is worked out
by ``training.tracking.mlflow_params``; scoring the logged model on the test split is
``training.tracking.evaluation``.

Bounded waits: every MLflow HTTP call runs under ``bounded_mlflow_env()``, which sets
``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / backoff (only where the
environment does not already set them). MLflow's defaults (120 s timeout, 7 retries with
exponential backoff) let one call to a dead server hang for many minutes; with ours a refused
connection fails in under 10 s and a black-holed one in about 70 s (4 tries x 15 s + 0/2/4 s
backoff). This covers artifacts too, as long as the tracking server proxies them (the default
``mlflow server`` mode, used here); a client that writes to S3 directly would use boto's own
timeouts instead.

mlflow and mxnet are imported inside the functions: importing this module is cheap (pure
helpers only), so Airflow plugins may import it at module level.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from typing import Any

from training.tracking.evaluation import EvaluationData
from training.tracking.mlflow_params import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_PER_BATCH,
    chunked,
    flatten_params,
    metric_points,
    params_to_log,
    step_metric_points,
)

from training.tracking.runs import (MLFLOW_ENV_DEFAULTS, bounded_mlflow_env, environ_restored, find_run,
                                    get_or_create_experiment, log_tags, open_run, run_url)

__all__ = ["MLFLOW_ENV_DEFAULTS", "bounded_mlflow_env", "environ_restored", "find_run", "open_run", "run_url",
           "log_model_run"]

log = logging.getLogger(__name__)

CHALLENGER_ALIAS = "challenger"
LOGGED_MODEL_NAME = "model"
# Rows of the input example stored in the model (MLflow also replays it at log time).
MAX_EXAMPLE_ROWS = 5
REGISTRATION_WAIT_S = 60
# The run's test metric (README, demo output): the evaluator's accuracy_score under its old name.
TEST_ACCURACY = "test_accuracy"
# A regression run's headline test metric (with test_mae and test_r2, over every target).
TEST_RMSE = "test_rmse"


def pinned_requirements() -> list[str]:
    """Exact versions of what the pyfunc model needs, taken from this environment."""
    return [f"{pkg}=={metadata.version(pkg)}" for pkg in ("mlflow", "mxnet", "numpy", "pandas")]


def files_digest(paths: Sequence[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- MLflow logging


def _resolve_run(client: Any, *, experiment: str, run_id: str | None, run_name: str, tags: Mapping[str, str]) -> Any:
    if run_id is None:
        experiment_id = get_or_create_experiment(client, experiment)
        return client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
    run = client.get_run(run_id)
    if run.info.lifecycle_stage != "active":
        raise ValueError(f"MLflow run {run_id} is deleted; cannot reuse it")
    exp_name = client.get_experiment(run.info.experiment_id).name
    if exp_name != experiment:
        raise ValueError(f"MLflow run {run_id} belongs to experiment {exp_name!r}, not {experiment!r}")
    log.info("reusing MLflow run %s (retry)", run_id)
    return run


def _log_params(client: Any, run: Any, flat: Mapping[str, str]) -> int:
    from mlflow.entities import Param

    todo = params_to_log(run.data.params, flat)
    for batch in chunked(sorted(todo.items()), MAX_PARAMS_PER_BATCH):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in batch], synchronous=True)
    return len(todo)


def _log_metrics(client: Any, run: Any, points: Sequence[tuple[str, float, int]]) -> int:
    from mlflow.entities import Metric

    run_id = run.info.run_id
    # On a retry, skip (key, step) points an earlier attempt already logged.
    done: set[tuple[str, int]] = set()
    for key in {k for k, _, _ in points} & set(run.data.metrics):
        done.update((key, m.step) for m in client.get_metric_history(run_id, key))
    now = int(time.time() * 1000)
    todo = [Metric(k, v, now, s) for k, v, s in points if (k, s) not in done]
    for batch in chunked(todo, MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=batch, synchronous=True)
    return len(todo)


def _log_extra_artifact(client: Any, run_id: str, dest: str, path: str) -> None:
    """Log ``path`` at run-relative ``dest`` (a folder goes under ``dest``, a file becomes ``dest``)."""
    import posixpath
    import shutil
    import tempfile

    if os.path.isdir(path):
        client.log_artifacts(run_id, path, artifact_path=dest)
        return
    folder, name = posixpath.split(dest.strip("/"))
    if name == os.path.basename(path):
        client.log_artifact(run_id, path, artifact_path=folder or None)
        return
    with tempfile.TemporaryDirectory(prefix="mlflow-artifact-") as tmp:
        renamed = os.path.join(tmp, name)
        shutil.copyfile(path, renamed)
        client.log_artifact(run_id, renamed, artifact_path=folder or None)


def _existing_version(client: Any, name: str, run_id: str, digest: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    same = [v for v in versions if v.tags.get("model_sha256") == digest and v.status == "READY"]
    return max(same, key=lambda v: int(v.version)) if same else None


def logged_model_id(version: Any) -> str | None:
    """The LoggedModel behind a model version: MLflow's field where the store fills it, else the
    ``models:/<model_id>`` source the open-source store keeps; None for a version registered
    from a run's artifacts (before MLflow 3)."""
    if getattr(version, "model_id", None):
        return version.model_id
    ref = version.source[len("models:/"):] if version.source.startswith("models:/") else ""
    return ref if ref and "/" not in ref else None


def _version_model_uri(version: Any) -> str:
    model_id = logged_model_id(version)
    return f"models:/{model_id}" if model_id else version.source


def _register(client: Any, name: str, model_uri: str, model_id: str, run_id: str,
              tags: Mapping[str, str], link: str, run_name: str) -> Any:
    """A new version of ``name`` (created if missing) from a LoggedModel, linked to its run."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # Not mlflow.register_model: for a models:/<model_id> URI it records no run_id on the version.
    return client.create_model_version(
        name=name, source=model_uri, run_id=run_id, tags=dict(tags), run_link=link,
        description=f"{run_name}: trained by run {run_id}",
        await_creation_for=REGISTRATION_WAIT_S, model_id=model_id,
    )


def _example_frame(input_example: Any, loaded: Any) -> Any:
    columns = loaded.input_columns
    missing = [c for c in columns if c not in input_example.columns]
    if missing:
        raise ValueError(f"input_example lacks feature columns {missing[:20]}")
    example = input_example[list(columns)].head(MAX_EXAMPLE_ROWS).reset_index(drop=True)
    # float64 ('double' in the signature): CSV and JSON inputs decode to float64/int64, which
    # MLflow's schema enforcement will not narrow to float32. Categorical inputs stay text.
    text = [c["name"] for c in (loaded.preprocessing or {}).get("inputs", []) if c["kind"] == "categorical"]
    return example.astype({c: "float64" for c in columns if c not in text})


def _log_pyfunc(*, files: Mapping[str, str], input_example: Any, step: int, tags: Mapping[str, str]) -> Any:
    import mlflow
    from mlflow.models import infer_signature

    from training.tracking import pyfunc_model

    loaded = pyfunc_model.load_exported(files["symbol"], files["params"], files["meta"], files.get("preprocessing"))
    example = _example_frame(input_example, loaded)
    prediction = pyfunc_model.predict_frame(loaded, loaded.features(example))
    with warnings.catch_warnings():
        # An integer `label` output cannot be missing; MLflow's hint about NaN in ints is noise.
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
        signature = infer_signature(example, prediction)
    return mlflow.pyfunc.log_model(
        name=LOGGED_MODEL_NAME,
        # Models from code: the file itself is the model, so loading needs no pickle and no
        # importable `training` package.
        python_model=pyfunc_model.__file__,
        artifacts=dict(files),
        signature=signature,
        input_example=example,
        pip_requirements=pinned_requirements(),
        step=step,
        tags=dict(tags),
    )


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (``log_model``, ``evaluate``) at ``uri`` for the duration.

    ``mlflow.set_tracking_uri`` also writes ``MLFLOW_TRACKING_URI`` (for subprocesses), so a
    plain set-and-restore would leave the variable changed, or set where the process had none:
    the fluent API goes back to the URI it resolved before, and the variable to what it was.
    (Public API only: that URI stays set in code afterwards, so a later change of the variable
    in this process no longer moves the fluent API; the project passes URIs explicitly.)
    """
    import mlflow

    previous = mlflow.get_tracking_uri()
    with environ_restored(["MLFLOW_TRACKING_URI"]):
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)


def _fluent_run(run_id: str, log_system_metrics: bool = False) -> contextlib.AbstractContextManager[Any]:
    """``start_run(run_id)`` (FINISHED on success, FAILED on an exception) unless already active."""
    import mlflow

    active = mlflow.active_run()
    if active is None:
        return mlflow.start_run(run_id=run_id, log_system_metrics=log_system_metrics)
    if active.info.run_id == run_id:
        return contextlib.nullcontext(active)
    raise RuntimeError(
        f"another MLflow run ({active.info.run_id}) is active in this thread; end it before "
        f"logging run {run_id}"
    )


def _evaluate(client: Any, run_id: str, model_uri: str, model_id: str, test_data: EvaluationData, step: int,
              what: str) -> dict[str, float]:
    """Score the logged model on ``test_data`` in the active run, linked to its LoggedModel, and add
    ``test_accuracy`` at the model's step; returns the metrics. A retry whose earlier attempt got
    this far finds them on the LoggedModel (from this run, on this data) and reads them back
    instead of scoring again."""
    import mlflow

    from training.tracking.evaluation import evaluate_model

    dataset = test_data.dataset()
    done = {m.key: m.value for m in client.get_logged_model(model_id).metrics
            if m.run_id == run_id and m.dataset_digest == dataset.digest}
    if (TEST_RMSE if test_data.task == "regression" else TEST_ACCURACY) in done:
        log.info("%s was already evaluated on this test split by run %s", what, run_id)
        return done
    started = time.monotonic()
    if test_data.task == "regression":
        metrics = _evaluate_regression(model_uri, model_id, test_data, dataset, step, what)
    else:
        result = evaluate_model(model_uri, dataset, test_data.classes, model_id=model_id, what=what)
        metrics = {key: float(value) for key, value in result.metrics.items()}
        metrics[TEST_ACCURACY] = metrics["accuracy_score"]
        mlflow.log_metric(TEST_ACCURACY, metrics[TEST_ACCURACY], step=step, model_id=model_id, dataset=dataset)
    log.info("evaluated %s on %d test rows in %.1f s: %s", what, len(test_data.frame), time.monotonic() - started,
             metrics)
    return metrics


def _evaluate_regression(model_uri: str, model_id: str, test_data: EvaluationData, dataset: Any, step: int,
                         what: str) -> dict[str, float]:
    """MLflow's regressor evaluation plus ``test_rmse``/``test_mae``/``test_r2`` (at the model's step,
    linked to its LoggedModel) and the predicted-vs-true plot, in the active run."""
    import tempfile

    import mlflow

    from training.tracking.evaluation import evaluate_regressor
    from training.tracking.run_extras import predicted_vs_true_png

    scores = evaluate_regressor(model_uri, test_data, dataset, model_id=model_id, what=what)
    metrics = {key: float(value) for key, value in scores.result.metrics.items()}
    metrics.update(scores.metrics)
    for key, value in scores.metrics.items():
        mlflow.log_metric(key, value, step=step, model_id=model_id, dataset=dataset)
    with tempfile.TemporaryDirectory(prefix="mxpipe-plot-") as tmp:
        true = test_data.frame[test_data.truth_columns].to_numpy()
        plot = predicted_vs_true_png(true, scores.predictions, test_data.target_columns,
                                     os.path.join(tmp, "predicted_vs_true.png"))
        if plot is not None:
            mlflow.log_artifact(plot, "plots")
    return metrics


def _export_files(model_dir: str) -> tuple[dict[str, str], str]:
    """The exported model's files and the digest of their bytes (a retry's reuse test)."""
    from training.tracking.pyfunc_model import find_export_files

    files = find_export_files(model_dir)
    return files, files_digest([files[k] for k in ("symbol", "params", "meta", "preprocessing") if k in files])


def _existing_artifacts(artifacts: Mapping[str, str]) -> dict[str, str]:
    for dest, path in artifacts.items():
        if not os.path.exists(path):
            raise FileNotFoundError(f"artifact {dest!r}: {path} does not exist")
    return dict(artifacts)


def _log_run_contents(client: Any, run: Any, *, refresh_tags: bool, tags: dict[str, str],
                      points: list, dataset: Mapping[str, Any] | None, extra: Mapping[str, str]) -> int:
    """Tags (refreshed on a retry: they are mutable), metric points, the dataset input and the extra
    artifacts of the active run; returns the number of metric points logged."""
    rid = run.info.run_id
    if refresh_tags:
        log_tags(client, rid, tags)
    n_metrics = _log_metrics(client, run, points)
    if dataset is not None:
        from training.tracking.run_extras import log_dataset_input

        log_dataset_input(dataset["manifest"], dataset["manifest_uri"], dataset["digest"])
    for dest, path in extra.items():
        _log_extra_artifact(client, rid, dest, path)
    return n_metrics


def _logged_model(client: Any, registered_model_name: str, rid: str, digest: str, *, retry: bool,
                  files: Mapping[str, str], input_example: Any, step: int,
                  tags: dict[str, str]) -> tuple[Any, str, str]:
    """``(version or None, model_uri, model_id)``: on a retry, the version an earlier attempt
    registered from this run with the same bytes; otherwise the pyfunc model, logged now and not
    yet registered."""
    reusable = _existing_version(client, registered_model_name, rid, digest) if retry else None
    if reusable is not None:
        log.info("version %s of %s was already registered from run %s with these bytes; reusing it",
                 reusable.version, registered_model_name, rid)
        return reusable, _version_model_uri(reusable), logged_model_id(reusable)
    info = _log_pyfunc(files=files, input_example=input_example, step=step, tags=tags)
    return None, info.model_uri, info.model_id


def selection_tags(best: Mapping[str, Any] | None) -> dict[str, str]:
    """Tags recording which epoch's parameters the model holds (the worker's ``best`` summary,
    ``training.loop.early_stop``): ``best.*`` (metric, mode, epoch, value, global step),
    ``model.epoch_exported`` ("best" or "last") and ``early_stopped_at`` (the epoch training
    stopped after, or "no"). None (nothing tracked): no tags."""
    if not best:
        return {}
    stopped = best["stopped_at_epoch"]
    return {"best.metric": best["metric"], "best.mode": best["mode"], "best.epoch": str(best["best_epoch"]),
            "best.value": repr(best["best_value"]), "best.step": str(best["best_step"]),
            "model.epoch_exported": best["exported"], "early_stopped_at": "no" if stopped is None else str(stopped)}


def selection_metrics(best: Mapping[str, Any] | None) -> dict[str, float]:
    """The same as metrics: ``best_epoch``, ``best_<metric>`` and, when it stopped early,
    ``early_stopped_epoch``."""
    if not best or best["best_epoch"] is None:
        return {}
    metrics = {"best_epoch": float(best["best_epoch"]), f"best_{best['metric']}": float(best["best_value"])}
    if best["stopped_at_epoch"] is not None:
        metrics["early_stopped_epoch"] = float(best["stopped_at_epoch"])
    return metrics


def _score_and_register(client: Any, rid: str, url: str, run_name: str, name: str, version: Any, model_uri: str,
                        model_id: str, test_data: EvaluationData | None, step: int,
                        version_tags: Mapping[str, str]) -> tuple[dict[str, float], Any]:
    """Score the logged model on ``test_data``, register it (unless a retry found its version) and
    point the ``challenger`` alias at it: ``(test metrics, version)``.

    Called after the system-metrics run part has ended, never beside its thread:
    mlflow.models.evaluate registers import hooks under MLflow's import-hook lock while the
    thread's lazy imports take the same lock and Python's import locks in the other order.
    Register tasks hung for good there, in the evaluator's registry and in its autologging setup.
    """
    with _fluent_run(rid):
        test_metrics = {} if test_data is None else _evaluate(
            client, rid, model_uri, model_id, test_data, step, f"{name} model {model_id}")
        if version is None:
            version = _register(client, name, model_uri, model_id, rid, {**version_tags, "model_id": model_id}, url,
                                run_name)
        client.set_registered_model_alias(name, CHALLENGER_ALIAS, version.version)
    return test_metrics, version


def log_model_run(
    *,
    tracking_uri: str,
    experiment: str,
    run_name: str,
    tags: dict[str, str],
    params: dict,
    epoch_metrics: list[dict[str, float]],
    final_metrics: dict[str, float],
    model_dir: str,
    registered_model_name: str,
    input_example: Any,
    artifacts: dict[str, str] | None = None,
    run_id: str | None = None,
    dataset: Mapping[str, Any] | None = None,
    log_system_metrics: bool = False,
    step_metrics: Sequence[Mapping[str, float]] = (),
    test_data: EvaluationData | None = None,
    selection: Mapping[str, Any] | None = None,
) -> dict:
    """Log params, metrics, extra artifacts and the pyfunc model; score the logged model on
    ``test_data``; register it as ``challenger``.

    ``artifacts`` maps a run-relative artifact path to a local file (logged under that name, e.g.
    ``{"manifest.json": "/tmp/x/manifest.json"}`` or ``{"reports/val.json": ...}``) or to a local
    folder (its files logged under that path). ``dataset`` (``{"manifest", "manifest_uri",
    "digest"}``) becomes the run's ``mlflow.data`` input; ``log_system_metrics`` samples MLflow's
    system metrics while this call logs (the training job's own processes are not covered).
    ``step_metrics`` (the worker's ``step_history``: ``{"step": global_step, "train_loss": …}``)
    are logged as ``train_loss_step`` etc. at ``step=global_step``, in the same batches.
    ``test_data`` is scored by MLflow's classifier evaluator (``evaluation.evaluate_model``) before
    the version is registered: its metrics (``accuracy_score``, ``f1_score``, ... and
    ``test_accuracy``, the same accuracy) and plots go to the run, the metrics to the LoggedModel
    too. ``selection`` (the worker's ``best`` summary) is recorded as the tags of ``selection_tags``
    on the run and the version, and as the metrics of ``selection_metrics``. Returns ``run_id,
    experiment_id, model_uri, registered_model_name, version, run_url`` and ``test_metrics``
    (empty without ``test_data``).
    """
    from mlflow import MlflowClient

    # Deterministic checks first: they must fail before anything is created.
    files, digest = _export_files(model_dir)
    flat = flatten_params(params)
    points, final_step = metric_points(epoch_metrics, {**final_metrics, **selection_metrics(selection)})
    points += step_metric_points(step_metrics)
    extra = _existing_artifacts(artifacts or {})
    str_tags = {**{str(k): str(v) for k, v in tags.items()}, **selection_tags(selection)}
    started = time.monotonic()

    with bounded_mlflow_env(), _tracking_uri(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        run = _resolve_run(client, experiment=experiment, run_id=run_id, run_name=run_name, tags=str_tags)
        rid, experiment_id = run.info.run_id, run.info.experiment_id
        url = run_url(tracking_uri, experiment_id, rid)
        # Before start_run: a conflicting retry must not flip the original run to FAILED.
        n_params = _log_params(client, run, flat)

        with _fluent_run(rid, log_system_metrics):
            n_metrics = _log_run_contents(client, run, refresh_tags=run_id is not None, tags=str_tags,
                                          points=points, dataset=dataset, extra=extra)
            version_tags = {**str_tags, "source_run_id": rid, "run_name": run_name,
                            "experiment": experiment, "model_sha256": digest}
            version, model_uri, model_id = _logged_model(
                client, registered_model_name, rid, digest, retry=run_id is not None, files=files,
                input_example=input_example, step=final_step, tags=version_tags)
        test_metrics, version = _score_and_register(
            client, rid, url, run_name, registered_model_name, version, model_uri, model_id, test_data, final_step,
            version_tags)

    log.info("logged run %s (%d params, %d metric points) and registered %s version %s as %r in %.1f s",
             rid, n_params, n_metrics, registered_model_name, version.version, CHALLENGER_ALIAS,
             time.monotonic() - started)
    return {"run_id": rid, "experiment_id": experiment_id, "model_uri": model_uri,
            "registered_model_name": registered_model_name, "version": str(version.version), "run_url": url,
            "test_metrics": test_metrics}
