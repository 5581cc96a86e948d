"""Skipping what has not changed, without servers: which config fields decide the model
(``training.loop.resume.model_digest``), the training inputs and their tags, the match over a
registry's versions (``training.tracking.reuse.choose``) and the reuse check's decision
(``plugins.pipeline_tasks.check_reuse``, the registry search faked)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from common.config import TrainConfig, overlay, recipe
from training.loop.resume import model_digest, resume_digest
from training.tracking import reuse
from training.tracking.reuse import NONE, Search, TrainingInputs, changed_inputs, choose

pytestmark = pytest.mark.unit

BASE = recipe("debug", "s3://bucket/digits.csv")


def _with(**sections: dict) -> TrainConfig:
    return TrainConfig.from_dict(overlay(BASE.to_dict(), sections))


# Fields that decide the trained model: each one changes the digest.
@pytest.mark.parametrize("change", [
    {"optim": {"epochs": BASE.optim.epochs + 1}},
    {"optim": {"learning_rate": BASE.optim.learning_rate * 2}},
    {"seed": BASE.seed + 1},
    {"model": {"hidden": [64, 32]}},
    {"model": {"dropout": 0.25}},
    {"data": {"val_fraction": 0.2}},
    # A resume may change these (elastic, export choice); a fresh training would give another model.
    {"cluster": {"num_workers": BASE.cluster.num_workers + 1}},
    {"checkpoint": {"export_epoch": "last" if BASE.exports_best else "best"}},
    {"cluster": {"kvstore": "dist_async", "optimizer_on": "servers"}},
], ids=["epochs", "learning_rate", "seed", "hidden", "dropout", "val_fraction", "num_workers", "export_epoch",
        "kvstore"])
def test_a_field_that_decides_the_model_changes_the_model_digest(change):
    assert model_digest(_with(**change)) != model_digest(BASE)


# Fields that change how the training runs, not what it produces: the digest stays.
@pytest.mark.parametrize("change", [
    {"checkpoint": {"every_n_steps": 7}},
    {"checkpoint": {"keep": 5, "async_upload": False}},
    {"cluster": {"job_timeout_s": 3600.0, "stall_timeout_s": 300.0}},
    {"cluster": {"backend": "hosts"}},
    {"cluster": {"num_servers": 3}},
    {"data": {"prefetch_batches": 4}},
])
def test_cadence_bounds_and_placement_leave_the_model_digest(change):
    assert model_digest(_with(**change)) == model_digest(BASE)


def test_the_worker_count_is_in_the_model_digest_but_not_in_the_resume_digest():
    """An elastic resume may change it (same resume digest); a fresh run on other workers trains
    another global batch."""
    more = _with(cluster={"num_workers": BASE.cluster.num_workers + 1})
    assert resume_digest(more) == resume_digest(BASE) and model_digest(more) != model_digest(BASE)


INPUTS = TrainingInputs("m" * 64, "c" * 16)
# One changed input of each kind.
CHANGES = {"data": {"manifest_digest": "n" * 64}, "config": {"config_digest": "d" * 16},
           "model code": {"code_sha256": "a" * 64}, "warm start": {"warm_start": "s3://b/ckpt@40"}}


def _version(version: int, inputs: TrainingInputs, *, status: str = "READY", run_id: str | None = None,
             **extra_tags: str) -> SimpleNamespace:
    return SimpleNamespace(version=str(version), status=status, run_id=run_id or f"run{version}",
                           tags={**inputs.tags(), **extra_tags})


def _run(run_id: str, status: str = "FINISHED", stage: str = "active") -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=status, lifecycle_stage=stage))


def _runs(**statuses: str):
    return lambda run_id: _run(run_id, statuses.get(run_id, "FINISHED"))


def test_inputs_of_the_shard_pointers_and_the_warm_start():
    inputs = TrainingInputs.of("m", "c", None, {"prefix": "s3://b/dag/run/checkpoints", "step": 40, "run_id": "r"})
    assert inputs == TrainingInputs("m", "c", NONE, "s3://b/dag/run/checkpoints@40")
    assert TrainingInputs.of("m", "c", "abc", None) == TrainingInputs("m", "c", "abc", NONE)
    tags = inputs.tags()
    assert tags[reuse.INPUTS_TAG] == inputs.digest() and tags["mxpipe.input.warm_start"] == inputs.warm_start


def test_the_same_inputs_match_the_version_trained_on_them():
    found = choose([_version(3, INPUTS)], INPUTS, _runs())
    assert found is not None and found[0].version == "3" and found[1].info.run_id == "run3"


@pytest.mark.parametrize("kind", CHANGES)
def test_a_changed_input_of_each_kind_matches_nothing_and_is_named(kind):
    changed = dataclasses.replace(INPUTS, **CHANGES[kind])
    assert changed.digest() != INPUTS.digest()
    assert choose([_version(3, INPUTS)], changed, _runs()) is None
    assert changed_inputs(changed, _version(3, INPUTS).tags) == list(CHANGES[kind])


def test_the_newest_finished_ready_version_is_chosen():
    versions = [_version(2, INPUTS), _version(5, INPUTS, run_id="failed"), _version(4, INPUTS, status="PENDING"),
                _version(3, INPUTS)]
    found = choose(versions, INPUTS, _runs(failed="FAILED"))
    assert found is not None and found[0].version == "3"


def test_a_version_whose_run_failed_or_is_gone_is_not_reused():
    assert choose([_version(1, INPUTS)], INPUTS, _runs(run1="FAILED")) is None
    assert choose([_version(1, INPUTS)], INPUTS, lambda run_id: None) is None
    assert choose([_version(1, INPUTS)], INPUTS, lambda run_id: _run(run_id, stage="deleted")) is None


def test_a_version_carrying_the_combined_digest_but_another_input_is_not_reused():
    """Every input is compared, not the search key alone."""
    forged = _version(1, INPUTS, **{"mxpipe.input.code_sha256": "x" * 64})
    assert choose([forged], INPUTS, _runs()) is None


def test_the_log_line_says_which_input_changed_since_which_version():
    changed = dataclasses.replace(INPUTS, **CHANGES["data"])
    line = Search(None, "7", ("manifest_digest",)).explain(changed, "digits")
    assert "manifest_digest changed since version 7 of digits" in line
    assert "no version of digits" in Search(None).explain(INPUTS, "digits")


# ------------------------------------------------------------------ the reuse check's decision

def _check(monkeypatch, search: Search, **params) -> dict:
    from plugins import pipeline_tasks

    seen: dict = {}

    def fake_find(uri, name, inputs):
        seen.update(name=name, inputs=inputs)
        return search

    monkeypatch.setattr(reuse, "find_reusable", fake_find)
    monkeypatch.setattr(pipeline_tasks, "warm_start_checkpoint", lambda *a: None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    shards = {"manifest_digest": "m" * 64, "model_code": None}
    decision = pipeline_tasks.check_reuse(pipeline_tasks.config_xcom(BASE),
                                          {"registered_model_name": "digits", **params}, shards, "dag", "run")
    assert seen["name"] == "digits"
    assert seen["inputs"] == TrainingInputs("m" * 64, model_digest(BASE))
    return decision


MATCH = reuse.Reusable(name="digits", version="3", mlflow_run_id="abc", dag_id="dag", dag_run_id="earlier",
                       run_url="http://mlflow/#/runs/abc", metrics={"test_accuracy": 0.9}, review="")


def test_a_match_is_reused(monkeypatch):
    decision = _check(monkeypatch, Search(MATCH))
    assert decision["reusable"] == dataclasses.asdict(MATCH)
    assert "match version 3 of digits, trained by DAG run dag/earlier" in decision["reason"]


def test_force_trains_although_an_earlier_run_matches(monkeypatch):
    decision = _check(monkeypatch, Search(MATCH), force=True)
    assert decision["reusable"] is None and "force" in decision["reason"]


def test_no_match_trains(monkeypatch):
    decision = _check(monkeypatch, Search(None, "2", ("config_digest",)))
    assert decision["reusable"] is None and decision["inputs"]["manifest_digest"] == "m" * 64


def test_the_log_line_names_a_reused_versions_review_outcome():
    rejected = dataclasses.replace(MATCH, review="rejected")
    assert "(MLflow run abc, review: rejected)" in Search(rejected).explain(INPUTS, "digits")
    assert "review" not in Search(MATCH).explain(INPUTS, "digits")


# ------------------------------------------------------------------ one warm start per run

def moving_champion(monkeypatch) -> None:
    """A registry where ``models:/digits@champion`` moves at each resolution: the n-th finds
    version n, trained by run ``run-<n>`` (checkpoint ``s3://b/run-<n>/checkpoints`` at step
    10n), as if a new champion were registered between any two resolutions."""
    from training.tracking import warm_start

    champions = iter(range(1, 100))

    def moving_alias(source, **_):
        n = next(champions)
        return SimpleNamespace(as_dict=lambda: {"run_id": f"run-{n}", "prefix": f"s3://b/run-{n}/checkpoints",
                                                "step": 10 * n, "model": "digits", "version": str(n)})

    monkeypatch.setattr(warm_start, "resolve_checkpoint", moving_alias)


def test_every_train_attempt_loads_the_warm_start_the_reuse_check_resolved_though_the_alias_moved(
        monkeypatch, tmp_path):
    """``models:/digits@champion`` names one checkpoint at the reuse check, another once train
    starts (a new champion registered in between) and another at train's retry: each attempt's
    job loads the reuse check's, the checkpoint the run's inputs (and so its version's input
    tags) name. The registry is faked: each resolution of the alias finds the next champion
    (``moving_champion``).
    The operator gets check_reuse's XCom as the training DAG renders it (tests/dag checks the
    wiring); its prepare_job and the job document are real, on a local cluster and local storage."""
    from infra.cluster import ClusterSpec
    from infra.local_cluster import LocalCluster
    from plugins import pipeline_tasks
    from plugins.train_operator import TrainJobOperator
    from training.launch.job import JobSpec

    moving_champion(monkeypatch)
    monkeypatch.setattr(reuse, "find_reusable", lambda uri, name, inputs: Search(None))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MXPIPE_LIVE_TRACKING", "0")
    params = {"registered_model_name": "digits", "warm_start": "models:/digits@champion"}
    shards = {"manifest_digest": "m" * 64, "model_code": None, "shards_prefix": "s3://b/shards/m"}
    config = pipeline_tasks.config_xcom(BASE)

    decision = pipeline_tasks.check_reuse(config, params, shards, "dag", "run")
    assert decision["inputs"]["warm_start"] == "s3://b/run-1/checkpoints@10"
    assert decision["warm_start"]["checkpoint"]["prefix"] == "s3://b/run-1/checkpoints"

    cluster = LocalCluster("dag--run", ClusterSpec(run_tag="dag--run", workers=1, servers=1), str(tmp_path / "home"))
    cluster.write_record()
    started = []
    monkeypatch.setattr(LocalCluster, "start_supervisor",
                        lambda self, job_uri, **kw: started.append(job_uri) or {"host": "here"})
    op = TrainJobOperator(task_id="train", cluster=cluster.describe(), shards=shards, config=config,
                          warm_start=decision[pipeline_tasks.WARM_START_XCOM_KEY])
    try:
        for try_number in (1, 2):  # the first attempt, then a retry (its job's supervisor gone)
            ti = SimpleNamespace(try_number=try_number, xcom_push=lambda **kw: None)
            job = op.submit_job({"dag": SimpleNamespace(dag_id="dag"), "run_id": "run", "ti": ti, "params": params})
            assert JobSpec.load(job["job_uri"]).warm_start_prefix == "s3://b/run-1/checkpoints", try_number
    finally:
        cluster.remove_record()
    assert len(started) == 2
