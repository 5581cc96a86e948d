"""Exact resume, torn/corrupt checkpoints, preemption, encryption and elastic resume, with real
multi-process ps-lite jobs checkpointing to a real S3 server (SeaweedFS).

The reference is one uninterrupted job (module fixture); a job killed (SIGKILL, SIGTERM, or in
the middle of a checkpoint upload) and resumed must end with the same parameters. The model has
dropout so that the per-step RNG re-seeding is exercised too.
"""
import dataclasses
import io
import json
import logging
import os
import re
import time

import numpy as np
import pytest
from common import storage
from data_checks.shard import shard_dataset
from training.checkpoint.store import CheckpointKeyError, CheckpointStore, store_for
from common.config import recipe
from common.events import EXIT_PREEMPTED
from training.launch.launcher import JobFailed
from testkit.local_jobs import make_job as _job, run_job as _run, shard_digits

pytestmark = pytest.mark.integration

# 20 steps per epoch with 2 workers; checkpoints at 7, 14, (20: epoch end), 21, 28, 35, 40. No
# restart in place: each fault ends the job and the next job resumes, as after an Airflow retry
# (restarts in place resume the same way: tests/integration/test_role_restarts.py).
OVERRIDES = {"optim": {"epochs": 2}, "model": {"hidden": (32,), "dropout": 0.2},
             "checkpoint": {"every_n_steps": 7, "keep": 3}, "cluster": {"max_restarts_without_progress": 0}}
EXACT_ATOL = 1e-6


@pytest.fixture(scope="module")
def shards(s3_server, digits_csv):
    cfg, shards_prefix = shard_digits(f"s3://{s3_server.bucket}/test-ckpt-resume", digits_csv)
    return cfg.replace(**OVERRIDES), shards_prefix


def _final_params(job):
    ckpt = store_for(job.checkpoint_prefix, job.config.checkpoint).latest()
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return ckpt, {k: arrays[k].copy() for k in arrays.files}


def _max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.fixture(scope="module")
def reference(shards, s3_server, tmp_path_factory):
    cfg, shards_prefix = shards
    prefix = f"s3://{s3_server.bucket}/test-ckpt-reference"
    job = _job(cfg, shards_prefix, prefix)
    _run(job, prefix, tmp_path_factory.mktemp("reference"))
    ckpt, params = _final_params(job)
    assert ckpt.step == 40 and ckpt.state["optimizer_state"]
    return params


@pytest.fixture(scope="module")
def reference_steps(reference, s3_server):
    """The uninterrupted job's per-step records (every step: step_metrics_every_n=1)."""
    metrics = json.loads(storage.get_bytes(f"s3://{s3_server.bucket}/test-ckpt-reference/metrics.json"))
    assert [r["step"] for r in metrics["step_history"]] == list(range(1, 41))
    return metrics["step_history"]


def _resumes_exactly(job, prefix, tmp_path, caplog, reference, expect_step, reference_steps=None):
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    caplog.clear()
    _run(job, prefix, tmp_path)
    resumed = re.findall(r"resumed from step (\d+) .*optimizer state (\w+)", caplog.text)
    assert resumed and int(resumed[0][0]) == expect_step and resumed[0][1] == "restored", caplog.text[-3000:]
    ckpt, params = _final_params(job)
    assert ckpt.step == 40
    diff = _max_diff(params, reference)
    print(f"max |resumed - uninterrupted| = {diff:.3g}")
    assert diff <= EXACT_ATOL
    if reference_steps is not None:  # the resumed run's per-step curve: the same steps, no duplicates
        steps = json.loads(storage.get_bytes(job.metrics_uri))["step_history"]
        assert [r["step"] for r in steps] == [r["step"] for r in reference_steps]
        assert [r["train_loss"] for r in steps] == pytest.approx([r["train_loss"] for r in reference_steps],
                                                                 rel=1e-5)
    return diff


def test_sigkill_then_resume_matches_uninterrupted_run(shards, reference, reference_steps, s3_prefix, tmp_path,
                                                       caplog):
    cfg, shards_prefix = shards
    job = _job(cfg, shards_prefix, s3_prefix)
    with pytest.raises(JobFailed) as failed:
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": "30", "MXPIPE_FAULT_KILL_RANK": "1"})
    assert "SIGKILL" in str(failed.value) and not failed.value.deterministic
    # 28 unless the async writer skipped it because 21 was still uploading (then 21); on a loaded
    # machine an upload can outlast 7 steps twice, skipping 21 and 28 (then the epoch end, 20).
    newest = CheckpointStore(job.checkpoint_prefix).committed_steps()[0]
    assert newest in (20, 21, 28)
    diff = _resumes_exactly(job, s3_prefix, tmp_path, caplog, reference, expect_step=newest,
                            reference_steps=reference_steps)
    assert diff == 0.0  # measured: bit-identical (2 workers: the server's float sum is order-free)


def test_sigterm_writes_an_emergency_checkpoint_and_exits_retryable(shards, reference, reference_steps, s3_prefix,
                                                                      tmp_path, caplog):
    cfg, shards_prefix = shards
    job = _job(cfg, shards_prefix, s3_prefix)
    with pytest.raises(JobFailed) as failed:
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_TERM_STEP": "31", "MXPIPE_FAULT_KILL_RANK": "0"})
    assert failed.value.exit_code == EXIT_PREEMPTED and not failed.value.deterministic, str(failed.value)
    assert CheckpointStore(job.checkpoint_prefix).committed_steps()[0] == 31  # emergency, off-cadence
    _resumes_exactly(job, s3_prefix, tmp_path, caplog, reference, expect_step=31, reference_steps=reference_steps)


def test_kill_during_upload_leaves_a_torn_checkpoint_that_is_never_loaded(shards, reference, s3_prefix, tmp_path,
                                                                           caplog):
    cfg, shards_prefix = shards
    # Synchronous writes, so that step 28 is certainly attempted (async may skip a periodic one).
    job = _job(cfg, shards_prefix, s3_prefix, checkpoint={"async_upload": False})
    with pytest.raises(JobFailed, match="SIGKILL"):
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_IN_UPLOAD_STEP": "28"})
    store = CheckpointStore(job.checkpoint_prefix)
    assert 28 in store.steps() and 28 not in store.committed_steps()
    assert not storage.exists(storage.join(store.step_uri(28), "MANIFEST.json"))
    assert store.latest().step == 21
    _resumes_exactly(job, s3_prefix, tmp_path, caplog, reference, expect_step=21)


def test_auto_cadence_plans_from_the_measured_cost_and_resumes_exactly(shards, reference, reference_steps, s3_prefix,
                                                                       tmp_path, caplog):
    """checkpoint.every_n_steps = "auto" (a failure every 2 s and 0.1 s steps, so the interval
    is a few steps): rank 0 logs its plan and its inputs, and a job killed and resumed ends
    bit-identical."""
    cfg, shards_prefix = shards
    job = _job(cfg, shards_prefix, s3_prefix, checkpoint={"every_n_steps": "auto", "mtbf_s": 2.0})
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    with pytest.raises(JobFailed) as failed:
        # Bootstrap saves at 10, 20 (epoch end), 30: planned at 30 (a step time between periodic saves).
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": "35", "MXPIPE_FAULT_KILL_RANK": "1",
                                            "MXPIPE_FAULT_STEP_DELAY_S": "0.1"})
    assert "SIGKILL" in str(failed.value) and not failed.value.deterministic
    plans = re.findall(r"checkpoint cadence \(auto\).*: (every \d+ steps .*MTBF 2s.*)", caplog.text)
    assert plans, caplog.text[-3000:]
    print("auto cadence plans:", *plans, sep="\n  ")
    # ~0.1 s steps: the plan's step time is measured (tens of ms at least), not the Python loop's
    # queueing speed (well under 1 ms a step); a loaded machine only makes it longer.
    step_ms = float(re.search(r"step time ([\d.]+)ms", plans[0]).group(1))
    assert int(plans[0].split()[1]) < 40 and 50.0 <= step_ms < 2000.0, plans[0]
    newest = CheckpointStore(job.checkpoint_prefix).committed_steps()[0]
    diff = _resumes_exactly(job, s3_prefix, tmp_path, caplog, reference, expect_step=newest,
                            reference_steps=reference_steps)
    assert diff == 0.0
    stats = json.loads(storage.get_bytes(job.metrics_uri))["checkpoint"]
    assert stats["auto_every_n_steps"] >= 1 and stats["failed"] == 0


def test_elastic_resume_two_workers_to_one(shards, s3_prefix, tmp_path, caplog):
    cfg, shards_prefix = shards
    job2 = _job(cfg, shards_prefix, s3_prefix, checkpoint={"elastic": True, "async_upload": False})
    with pytest.raises(JobFailed):
        _run(job2, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": "30", "MXPIPE_FAULT_KILL_RANK": "1"})
    # Without elastic, another worker count is refused as bad input (not retried).
    strict = _job(cfg, shards_prefix, s3_prefix, cluster={"num_workers": 1})
    with pytest.raises(JobFailed) as refused:
        _run(strict, s3_prefix, tmp_path)
    assert refused.value.deterministic and "checkpoint.elastic" in str(refused.value)

    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    job1 = _job(cfg, shards_prefix, s3_prefix, cluster={"num_workers": 1}, checkpoint={"elastic": True})
    _run(job1, s3_prefix, tmp_path)
    # 28 steps x 64 samples consumed; epoch 1 had used 8 steps x 64 = 512 samples, so with a
    # global batch of 32 it continues at step 16 of 40.
    assert "elastic resume: 2 workers → 1; epoch 1 continues at step 16 of 40" in caplog.text
    metrics = json.loads(storage.get_bytes(job1.metrics_uri))
    assert metrics["num_workers"] == 1 and [h["epoch"] for h in metrics["history"]] == [0, 1]
    assert metrics["global_step"] == 28 + (40 - 16)
    assert metrics["history"][-1]["val_accuracy"] > 0.6  # it kept learning (the reference: ~0.8)


@pytest.fixture(scope="module")
def custom_code(s3_server, tmp_path_factory):
    """The user's network package (testkit/custom_nets.py) in a folder outside the repo, staged on S3."""
    from common import model_code

    from testkit.custom_nets import write_package

    code_dir = write_package(str(tmp_path_factory.mktemp("user-nets")))
    return model_code.stage(code_dir, f"s3://{s3_server.bucket}/test-ckpt-custom-code")


def _custom_job(cfg, shards_prefix, prefix, staged, **overrides):
    """A job of the user's network (with dropout) whose roles fetch its staged code."""
    custom = cfg.replace(model={"name": "mynet.arch:build", "options": {"width": 24, "dropout": 0.2}})
    return dataclasses.replace(_job(custom, shards_prefix, prefix, **overrides), model_code_uri=staged.uri,
                               model_code_sha256=staged.sha256)


def test_a_custom_network_resumes_exactly(shards, custom_code, s3_prefix, tmp_path, caplog):
    """A network of the user's own (with dropout: the per-step re-seeding applies to it too),
    its code staged on S3 and fetched by every worker: killed at step 15 of one epoch and
    resumed, it ends with the parameters of an uninterrupted run of the same network."""
    cfg, shards_prefix = shards

    def job_under(prefix):
        return _custom_job(cfg, shards_prefix, prefix, custom_code, optim={"epochs": 1})

    uninterrupted = job_under(storage.join(s3_prefix, "uninterrupted"))
    _run(uninterrupted, storage.join(s3_prefix, "uninterrupted"), tmp_path)
    _, expected = _final_params(uninterrupted)
    assert {"0.inner.weight", "0.proj.weight"} <= set(expected), sorted(expected)  # the Residual block

    prefix = storage.join(s3_prefix, "resumed")
    job = job_under(prefix)
    with pytest.raises(JobFailed, match="SIGKILL"):
        _run(job, prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": "15", "MXPIPE_FAULT_KILL_RANK": "1"})
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    _run(job, prefix, tmp_path)
    resumed = re.findall(r"resumed from step (\d+) .*optimizer state (\w+)", caplog.text)
    assert resumed and int(resumed[0][0]) in (7, 14) and resumed[0][1] == "restored", caplog.text[-3000:]
    ckpt, params = _final_params(job)
    assert ckpt.step == 20 and _max_diff(params, expected) == 0.0


# -- the store against real S3 (no training job) ---------------------------------------------------


def _save(store, step, payload=None):
    return store.save(step, {"params.npz": payload or f"params-{step}".encode() * 100}, {"global_step": step})


def test_flipped_bytes_or_deleted_manifest_fall_back_to_the_previous(s3_prefix):
    store = CheckpointStore(s3_prefix, keep=4)
    for step in (10, 20, 30):
        _save(store, step)
    uri = store.file_uri(30, "params.npz")
    data = bytearray(storage.get_bytes(uri))
    data[5] ^= 0xFF
    storage.put_bytes(uri, bytes(data))
    assert store.latest().step == 20
    storage.s3_client().delete_object(**dict(zip(("Bucket", "Key"),
                                                 storage.split_s3(storage.join(store.step_uri(20), "MANIFEST.json")))))
    assert store.latest().step == 10


def test_retention_keeps_exactly_k_on_s3(s3_prefix):
    store = CheckpointStore(s3_prefix, keep=3, keep_every_n_steps=50)
    for step in range(10, 130, 10):
        _save(store, step)
    assert store.committed_steps() == [120, 110, 100, 50, 10]
    plain = CheckpointStore(storage.join(s3_prefix, "plain"), keep=3)
    for step in range(10, 70, 10):
        _save(plain, step)
    assert plain.committed_steps() == plain.steps() == [60, 50, 40]


def _sse_store(prefix, sse, kms_key_id=""):
    cfg = recipe("debug").checkpoint
    return store_for(prefix, type(cfg)(**{**cfg.__dict__, "sse": sse, "sse_kms_key_id": kms_key_id}))


def _spy_puts(monkeypatch):
    sent = []
    client = storage.s3_client()
    real = client.put_object

    def spy(**kw):
        sent.append(kw.get("ServerSideEncryption"))
        return real(**kw)

    monkeypatch.setattr(client, "put_object", spy)
    return sent


def test_sse_s3_header_is_sent_and_accepted_on_every_object(s3_prefix, monkeypatch):
    store = _sse_store(s3_prefix, "AES256")
    sent = _spy_puts(monkeypatch)
    _save(store, 10)
    assert sent == ["AES256"] * 3  # params, state, manifest
    assert store.latest().step == 10


def test_sse_kms_header_is_sent_and_a_refusal_is_a_clear_storage_error(s3_prefix, monkeypatch):
    """SeaweedFS has no KMS configured here: it answers SSE-KMS puts with InternalError. What
    matters is that the header is sent and a refusal surfaces as a StorageError naming the
    object (the async writer then retries and gives up, bounded)."""
    store = _sse_store(s3_prefix, "aws:kms", "test-key")
    sent = _spy_puts(monkeypatch)
    try:
        _save(store, 10)
    except storage.StorageError as exc:
        assert re.search(r"step-00000010/[0-9a-f]{16}/params\.npz", str(exc))  # the attempt's object
        print(f"SeaweedFS refused SSE-KMS: {exc}")
    else:
        assert store.latest().step == 10
    assert sent and set(sent) == {"aws:kms"}


def test_big_file_goes_up_in_parts_and_verifies(s3_prefix, monkeypatch):
    from training.checkpoint import store as checkpoint

    monkeypatch.setattr(checkpoint, "MULTIPART_THRESHOLD", 5 << 20)
    store = CheckpointStore(s3_prefix, keep=2, sse={"ServerSideEncryption": "AES256"})
    payload = os.urandom(12 << 20)
    _save(store, 10, payload)
    assert store.latest().files["params.npz"] == payload


def test_encrypted_checkpoint_on_s3_and_a_wrong_key(s3_prefix, monkeypatch):
    cfg = recipe("debug").checkpoint
    cfg = type(cfg)(**{**cfg.__dict__, "encryption_key_env": "MXPIPE_TEST_KEK"})
    monkeypatch.setenv("MXPIPE_TEST_KEK", "ab" * 32)
    _save(store_for(s3_prefix, cfg), 10)
    assert store_for(s3_prefix, cfg).latest().files["params.npz"] == b"params-10" * 100
    monkeypatch.setenv("MXPIPE_TEST_KEK", "cd" * 32)
    with pytest.raises(CheckpointKeyError, match=r"step-00000010: encrypted with another key than the one in "
                                                 r"\$MXPIPE_TEST_KEK"):
        store_for(s3_prefix, cfg).latest()


def test_wrong_key_fails_the_job_as_bad_input(shards, s3_prefix, tmp_path, monkeypatch):
    cfg, shards_prefix = shards
    job = _job(cfg, shards_prefix, s3_prefix, optim={"epochs": 1}, checkpoint={"encryption_key_env": "MXPIPE_KEK"})
    monkeypatch.setenv("MXPIPE_KEK", "ab" * 32)
    _run(job, s3_prefix, tmp_path)
    monkeypatch.setenv("MXPIPE_KEK", "cd" * 32)
    started = time.monotonic()
    with pytest.raises(JobFailed) as failed:
        _run(job, s3_prefix, tmp_path)
    assert failed.value.deterministic and "step-00000020: encrypted with another key" in str(failed.value)
    assert "cd" * 32 not in str(failed.value) and "ab" * 32 not in str(failed.value)
    assert time.monotonic() - started < 120


@pytest.fixture(scope="module")
def table_shards(s3_server):
    """A table with a text column and missing values, sharded with imputation (one-hot,
    standardised): (config, shards prefix, manifest)."""
    import pandas as pd

    rng = np.random.default_rng(5)
    frame = pd.DataFrame({"x": rng.normal(1e3, 50, 400), "kind": rng.choice(["a", "b", "c"], 400),
                          "label": rng.integers(0, 2, 400)})
    frame.loc[::11, "x"] = np.nan
    frame.loc[::17, "kind"] = None
    bucket = f"s3://{s3_server.bucket}/test-ckpt-prep"
    source = storage.join(bucket, "table.csv")
    storage.put_bytes(source, frame.to_csv(index=False).encode())
    cfg = recipe("debug", source).replace(data={"missing_values": "impute"}, optim={"epochs": 3},
                                          model={"hidden": (16,), "dropout": 0.2}, checkpoint={"every_n_steps": 3},
                                          cluster=OVERRIDES["cluster"])
    manifest = shard_dataset(cfg, storage.join(bucket, "shards"))
    return cfg, storage.join(bucket, "shards"), manifest


def test_resume_is_exact_on_a_preprocessed_table(table_shards, s3_server, s3_prefix, tmp_path, caplog):
    """Shards of a table with a text column and imputed missing values (one-hot, standardised):
    a job killed mid-run resumes to the uninterrupted job's parameters."""
    cfg, shards_prefix, manifest = table_shards
    assert manifest["preprocessing"]["imputed"]["train"] and manifest["num_features"] == 5
    ref_prefix = f"s3://{s3_server.bucket}/test-ckpt-prep/reference"
    ref = _job(cfg, shards_prefix, ref_prefix)
    _run(ref, ref_prefix, tmp_path)
    ref_ckpt, reference = _final_params(ref)
    job = _job(cfg, shards_prefix, s3_prefix)
    with pytest.raises(JobFailed):
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": "10", "MXPIPE_FAULT_KILL_RANK": "1"})
    _run(job, s3_prefix, tmp_path)
    ckpt, params = _final_params(job)
    assert ckpt.step == ref_ckpt.step and _max_diff(params, reference) <= EXACT_ATOL


@pytest.mark.parametrize("case", ["preprocessed-table", "custom-network"])
def test_elastic_resume_with_preprocessing_or_a_custom_network(case, request, s3_prefix, tmp_path, caplog):
    """Elastic resume (2 workers killed mid-run, resumed on 1) on a preprocessed table, and with
    the user's own network (its code fetched again by the new job's worker)."""
    if case == "preprocessed-table":
        cfg, shards_prefix, _ = request.getfixturevalue("table_shards")
        kill_step, epochs = "8", 3

        def job(**overrides):
            return _job(cfg, shards_prefix, s3_prefix, **overrides)
    else:
        cfg, shards_prefix = request.getfixturevalue("shards")
        staged, kill_step, epochs = request.getfixturevalue("custom_code"), "30", 2

        def job(**overrides):
            return _custom_job(cfg, shards_prefix, s3_prefix, staged, **overrides)

    with pytest.raises(JobFailed):
        _run(job(checkpoint={"elastic": True, "async_upload": False}), s3_prefix, tmp_path,
             env={"MXPIPE_FAULT_KILL_STEP": kill_step, "MXPIPE_FAULT_KILL_RANK": "1"})
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    one = job(cluster={"num_workers": 1}, checkpoint={"elastic": True})
    _run(one, s3_prefix, tmp_path)
    assert "elastic resume: 2 workers → 1" in caplog.text, caplog.text[-3000:]
    metrics = json.loads(storage.get_bytes(one.metrics_uri))
    assert metrics["num_workers"] == 1 and [h["epoch"] for h in metrics["history"]] == list(range(epochs))
    assert np.isfinite(metrics["history"][-1]["val_loss"])
