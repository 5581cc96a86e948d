"""Log a trained model to MLflow and register it as the ``challenger``.

``log_model_run`` takes a ``ModelRunRequest`` (what to log, where) and is what the training DAG's
register step calls (``training.tracking.job_registration``), from an Airflow task or a shell.
It is safe to retry: given the ``run_id`` of an earlier attempt it reuses that run, skips params
and metric points that are already there, reuses a model version already registered from the
same run with the same model bytes, and the test metrics already linked to that version's model.
MLflow params are immutable, so a retry that brings a *different* value for a logged key fails
at once with ``ParamConflictError`` (deterministic: not worth an Airflow retry) instead of the
server's generic 400. What is sent (flattened params, metric points, batch sizes) is worked out
by ``training.tracking.mlflow_params``; the logged model is scored on the test split by
``training.tracking.evaluation.score_model``, the scoring a review uses too.

Bounded waits: every MLflow HTTP call runs under ``runs.bounded_mlflow_env()``, which sets
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
from training.tracking.runs import (bounded_mlflow_env, fluent_tracking_uri, get_or_create_experiment, log_tags,
                                    run_url)

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
    """Score the logged model on ``test_data`` in the active run (``evaluation.score_model``, at the
    model's step): a classifier also gets ``test_accuracy``, a regressor the predicted-vs-true
    plot; returns the metrics. A retry whose earlier attempt got this far finds them on the
    LoggedModel (from this run, on this data) and reads them back instead of scoring again."""
    import mlflow

    from training.tracking.evaluation import score_model

    dataset = test_data.dataset()
    done = {m.key: m.value for m in client.get_logged_model(model_id).metrics
            if m.run_id == run_id and m.dataset_digest == dataset.digest}
    regression = test_data.task == "regression"
    if (TEST_RMSE if regression else TEST_ACCURACY) in done:
        log.info("%s was already evaluated on this test split by run %s", what, run_id)
        return done
    started = time.monotonic()
    scores = score_model(model_uri, test_data, dataset, model_id=model_id, what=what, step=step)
    metrics = {key: float(value) for key, value in scores.result.metrics.items()}
    if regression:
        _log_predicted_vs_true(test_data, scores.predictions)
    else:
        # score_model's: over the whole split (the evaluator's accuracy_score is of its sample).
        mlflow.log_metric(TEST_ACCURACY, metrics[TEST_ACCURACY], step=step, model_id=model_id, dataset=dataset)
    log.info("evaluated %s on %d test rows (the evaluator on %d of them) in %.1f s: %s", what,
             test_data.split_rows, len(test_data.frame), time.monotonic() - started, metrics)
    return metrics


def _log_predicted_vs_true(test_data: EvaluationData, predictions: Any) -> None:
    """A regressor's predicted-vs-true plot, under ``plots/`` of the active run."""
    import tempfile

    import mlflow

    from training.tracking.run_extras import predicted_vs_true_png

    with tempfile.TemporaryDirectory(prefix="mxpipe-plot-") as tmp:
        true = test_data.frame[test_data.truth_columns].to_numpy()
        plot = predicted_vs_true_png(true, predictions, test_data.target_columns,
                                     os.path.join(tmp, "predicted_vs_true.png"))
        if plot is not None:
            mlflow.log_artifact(plot, "plots")


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


@dataclass(frozen=True)
class ModelRunRequest:
    """What ``log_model_run`` logs, scores and registers, and where.

    ``artifacts`` maps a run-relative artifact path to a local file (logged under that name, e.g.
    ``{"manifest.json": "/tmp/x/manifest.json"}`` or ``{"reports/val.json": ...}``) or to a local
    folder (its files logged under that path). ``run_id``: an earlier attempt's run, reused (a
    retry); None creates a run. ``dataset`` (``{"manifest", "manifest_uri", "digest"}``) becomes
    the run's ``mlflow.data`` input; ``log_system_metrics`` samples MLflow's system metrics while
    the call logs (the training job's own processes are not covered). ``step_metrics`` (the
    worker's ``step_history``: ``{"step": global_step, "train_loss": …}``) are logged as
    ``train_loss_step`` etc. at ``step=global_step``, in the same batches. ``test_data`` is scored
    (``evaluation.score_model``) before the version is registered: its metrics (a classifier's
    ``accuracy_score``, ``f1_score``, ... and ``test_accuracy``, the same accuracy; a regressor's
    ``test_rmse``, ``test_mae``, ``test_r2`` beside the evaluator's) and plots go to the run, the
    metrics to the LoggedModel too. ``selection`` (the worker's ``best`` summary) is recorded as
    the tags of ``selection_tags`` on the run and the version, and as the metrics of
    ``selection_metrics``.
    """

    tracking_uri: str
    experiment: str
    run_name: str
    tags: Mapping[str, str]
    params: Mapping[str, Any]
    epoch_metrics: Sequence[Mapping[str, float]]
    final_metrics: Mapping[str, float]
    model_dir: str
    registered_model_name: str
    input_example: Any  # a pandas frame with (at least) the model's input columns
    artifacts: Mapping[str, str] = field(default_factory=dict)
    run_id: str | None = None
    dataset: Mapping[str, Any] | None = None
    log_system_metrics: bool = False
    step_metrics: Sequence[Mapping[str, float]] = ()
    test_data: EvaluationData | None = None
    selection: Mapping[str, Any] | None = None


def log_model_run(request: ModelRunRequest) -> dict[str, Any]:
    """Log params, metrics, extra artifacts and the pyfunc model; score the logged model on the
    request's ``test_data``; register it as ``challenger``. Returns ``run_id, experiment_id,
    model_uri, registered_model_name, version, run_url`` and ``test_metrics`` (empty without
    ``test_data``).
    """
    from mlflow import MlflowClient

    # Deterministic checks first: they must fail before anything is created.
    r = request
    files, digest = _export_files(r.model_dir)
    flat = flatten_params(dict(r.params))
    points, final_step = metric_points(list(r.epoch_metrics), {**r.final_metrics, **selection_metrics(r.selection)})
    points += step_metric_points(r.step_metrics)
    extra = _existing_artifacts(r.artifacts)
    str_tags = {**{str(k): str(v) for k, v in r.tags.items()}, **selection_tags(r.selection)}
    started = time.monotonic()

    with bounded_mlflow_env(), fluent_tracking_uri(r.tracking_uri):
        client = MlflowClient(tracking_uri=r.tracking_uri, registry_uri=r.tracking_uri)
        run = _resolve_run(client, experiment=r.experiment, run_id=r.run_id, run_name=r.run_name, tags=str_tags)
        rid, experiment_id = run.info.run_id, run.info.experiment_id
        url = run_url(r.tracking_uri, experiment_id, rid)
        # Before start_run: a conflicting retry must not flip the original run to FAILED.
        n_params = _log_params(client, run, flat)

        with _fluent_run(rid, r.log_system_metrics):
            n_metrics = _log_run_contents(client, run, refresh_tags=r.run_id is not None, tags=str_tags,
                                          points=points, dataset=r.dataset, extra=extra)
            version_tags = {**str_tags, "source_run_id": rid, "run_name": r.run_name,
                            "experiment": r.experiment, "model_sha256": digest}
            version, model_uri, model_id = _logged_model(
                client, r.registered_model_name, rid, digest, retry=r.run_id is not None, files=files,
                input_example=r.input_example, step=final_step, tags=version_tags)
        test_metrics, version = _score_and_register(
            client, rid, url, r.run_name, r.registered_model_name, version, model_uri, model_id, r.test_data,
            final_step, version_tags)

    log.info("logged run %s (%d params, %d metric points) and registered %s version %s as %r in %.1f s",
             rid, n_params, n_metrics, r.registered_model_name, version.version, CHALLENGER_ALIAS,
             time.monotonic() - started)
    return {"run_id": rid, "experiment_id": experiment_id, "model_uri": model_uri,
            "registered_model_name": r.registered_model_name, "version": str(version.version), "run_url": url,
            "test_metrics": test_metrics}
