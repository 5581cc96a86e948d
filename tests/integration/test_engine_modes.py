"""The training engine's modes in real jobs: every kvstore mode, several CPU contexts per worker,
the optimizers, an LR schedule with warmup across a resume, gradient accumulation, 2-bit
compression, and the per-epoch progress line.

Each job is the real ``python -m training worker`` under the project's detached supervisor, as a
DAG run starts it (scheduler + servers + workers as local processes for the ``dist_*`` modes),
reading digits shards from and checkpointing to a real S3 server (SeaweedFS). Jobs are kept tiny (MLP with 32 hidden units,
2 epochs of about 20 steps) so the file runs in a few minutes on 2 cores. What the modes compute
against a single-process reference is ``test_kvstore_reference.py``; here the question is
whether the engine itself runs, trains and counts right in each mode.
"""
import io
import json
import logging
import math
import os
import re
import sys

import numpy as np
import pytest

from common import storage
from data_checks.shard import shard_dataset
from training.checkpoint.store import store_for
from common.config import OPTIMIZERS, recipe
from common.events import EXIT_PREEMPTED
from training.launch.launcher import JobFailed
from tests.integration.kvstore_reference_worker import two_bit as _two_bit
from testkit.local_jobs import make_job, run_job

pytestmark = pytest.mark.integration

# Rows of the digits train split (70 % of 1,797) spread over 2 shards.
PROGRESS = re.compile(r"epoch (\d+) done: step=(\d+) loss=([\d.]+) samples/s=(\d+) \(all workers (\d+)\) "
                      r"eta=(\d+)s")


@pytest.fixture(scope="module")
def shards(s3_server, digits_csv):
    bucket = f"s3://{s3_server.bucket}/test-engine-{os.getpid()}"
    source = storage.join(bucket, "digits.csv")
    storage.put_bytes(source, digits_csv)
    cfg = recipe("debug", source).replace(optim={"epochs": 2})
    manifest = shard_dataset(cfg, storage.join(bucket, "shards"))
    return cfg, storage.join(bucket, "shards"), manifest


def _train(shards, s3_prefix, tmp_path, caplog, env=None, **overrides):
    cfg, prefix, _ = shards
    job = make_job(cfg, prefix, s3_prefix, **overrides)
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    roles = run_job(job, s3_prefix, tmp_path, env=env)
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    return job, metrics, roles


def _assert_trains(metrics, min_accuracy=0.5):
    losses = [h["train_loss"] for h in metrics["history"]]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert metrics["history"][-1]["val_accuracy"] > min_accuracy, metrics["history"][-1]


def _steps_per_epoch(manifest, workers, rows_per_step):
    shares = [sum(s["count"] for i, s in enumerate(x for x in manifest["shards"] if x["split"] == "train")
                  if i % workers == r) for r in range(workers)]
    return math.ceil(max(shares) / rows_per_step)


MODES = [
    # kvstore, workers, servers, contexts per worker, optimizer
    ("local", 1, 1, 1, "sgd"),
    ("device", 1, 1, 2, "nag"),
    ("dist_sync", 2, 2, 1, "adam"),
    ("dist_async", 2, 1, 1, "rmsprop"),
    ("dist_device_sync", 2, 1, 2, "adagrad"),
]


@pytest.mark.parametrize("kvstore,workers,servers,contexts,optimizer", MODES,
                         ids=[f"{m[0]}-w{m[1]}-s{m[2]}-c{m[3]}-{m[4]}" for m in MODES])
def test_every_kvstore_mode_trains(shards, s3_prefix, tmp_path, caplog, kvstore, workers, servers, contexts,
                                   optimizer):
    lr = {"sgd": 0.01, "nag": 0.01, "adagrad": 0.05}.get(optimizer, 0.005)
    flush = kvstore != "dist_async"  # one mode with IEEE denormals: the setting reaches every worker either way
    job, metrics, roles = _train(shards, s3_prefix, tmp_path, caplog,
                                 cluster={"kvstore": kvstore, "num_workers": workers, "num_servers": servers,
                                          "devices_per_worker": contexts, "flush_denormals": flush},
                                 optim={"optimizer": optimizer, "learning_rate": lr})
    _assert_trains(metrics)
    workers_started = [r for r in roles if r.startswith("worker-")]
    assert len(workers_started) == workers
    if kvstore in ("local", "device"):
        assert roles == ["worker-0"], f"a single-process kvstore needs no scheduler or servers: {roles}"
    else:
        assert roles[:1 + servers] == ["scheduler"] + [f"server-{i}" for i in range(servers)]
    contexts_logged = re.findall(r"worker 0/\d+ started \(kvstore=(\w+)\).*contexts \[(.*?)\]", caplog.text)
    assert contexts_logged and contexts_logged[0][0] == kvstore
    assert contexts_logged[0][1] == ", ".join(f"cpu({i})" for i in range(contexts))
    modes = re.findall(r"worker \d+/\d+ started .*; denormals (flushed to zero|kept \(IEEE\))", caplog.text)
    assert modes == ["flushed to zero" if flush else "kept (IEEE)"] * workers, modes
    # The per-epoch progress line: step, loss, samples/s (this worker and all), ETA.
    lines = PROGRESS.findall(caplog.text)
    assert sorted(int(m[0]) for m in lines) == sorted([0, 1] * workers), caplog.text[-3000:]
    assert all(int(m[3]) > 0 and int(m[4]) >= int(m[3]) for m in lines), lines
    steps = _steps_per_epoch(shards[2], workers, 32)
    assert metrics["global_step"] == 2 * steps
    last = [m for m in lines if m[0] == "1"]
    assert all(int(m[1]) == 2 * steps and m[5] == "0" for m in last), last  # the last epoch: nothing left


def test_every_optimizer_takes_a_training_step():
    """All seven optimizers through the engine's own trainer path (optim.optimizer_params +
    kvstore_sync.make_trainer + step.StepRunner) on a local kvstore, in this process: the loss
    of a fixed batch falls over a few steps. One dist job per optimizer would add minutes for
    no new code path (the distributed runs above use five of them)."""
    from common.mx import import_mxnet
    from training.loop.kvstore_sync import make_trainer
    from training.loop.optim import optimizer_params
    from training.loop.step import StepRunner, prepare

    mx = import_mxnet()
    rng = np.random.RandomState(0)
    X = rng.randn(64, 8).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32)
    idx = np.arange(64)
    base = recipe("debug").replace(cluster={"kvstore": "local", "num_workers": 1})
    rates = {"sgd": 0.1, "nag": 0.1, "adagrad": 0.1, "adadelta": 1.0, "rmsprop": 0.01, "adam": 0.01, "lamb": 0.01}
    assert set(rates) == set(OPTIMIZERS)
    for name in OPTIMIZERS:
        cfg = base.replace(optim={"optimizer": name, "learning_rate": rates[name], "batch_size": 32,
                                  "accumulate_steps": 2, "weight_decay": 1e-4})
        mx.random.seed(1)
        net = mx.gluon.nn.Dense(2, in_units=8)
        net.initialize(mx.init.Xavier())
        trainer = make_trainer(net.collect_params(), name, optimizer_params(cfg, 1, 10, 0),
                               mx.kv.create("local"), "workers", batch_size=cfg.global_batch(1))
        prepare(net, trainer, 2, use_amp=False)
        step = StepRunner(net, trainer, mx.gluon.loss.SoftmaxCrossEntropyLoss(), [mx.cpu()], batch_size=32,
                          accumulate_steps=2, global_batch=64)
        losses = [step(X, y, idx) for _ in range(8)]
        assert losses[-1] < losses[0], (name, losses)
        assert (step.micro_batches, step.optimizer_steps, trainer._optimizer.num_update) == (16, 8, 8), name


def _lr_at(step, *, peak, warmup, total, final=0.0):
    """MXNet's linear warmup then cosine (mx.lr_scheduler.CosineScheduler), written out."""
    if step < warmup:
        return peak * step / warmup
    if step <= total:
        return final + (peak - final) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2
    return final


def test_warmup_cosine_schedule_follows_the_global_step_across_a_resume(shards, s3_prefix, tmp_path, caplog):
    """Warmup longer than the first epoch, cosine after; a kill mid-epoch 1 and the retry's
    resume from an earlier checkpoint. The rate recorded at every epoch end (what the next step
    uses) must be the schedule's value at that global step, whether the epoch ran before or
    after the resume; the optimizer's update count must equal the global step."""
    from training.launch.launcher import JobFailed

    cfg, prefix, manifest = shards
    steps = _steps_per_epoch(manifest, 2, 32)
    total, warmup, peak = 3 * steps, steps + steps // 2, 0.01
    # No restart in place: the killed job ends and the next one (the retry's) resumes.
    overrides = {"optim": {"epochs": 3, "learning_rate": peak, "lr_schedule": "cosine", "warmup_steps": warmup},
                 "checkpoint": {"every_n_steps": 5}, "cluster": {"max_restarts_without_progress": 0}}
    job = make_job(cfg, prefix, s3_prefix, **overrides)
    kill_at = steps + 7
    fault = {"MXPIPE_FAULT_KILL_STEP": str(kill_at), "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    with pytest.raises(JobFailed):
        run_job(job, s3_prefix, tmp_path, env=fault)
    run_job(job, s3_prefix, tmp_path, env=fault)
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", caplog.text)]
    assert resumed and 0 < resumed[0] < kill_at, caplog.text[-3000:]
    assert "first step after resume done" in caplog.text
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    history = metrics["history"]
    assert [h["global_step"] for h in history] == [steps, 2 * steps, 3 * steps]
    for h in history:
        assert h["learning_rate"] == pytest.approx(_lr_at(h["global_step"], peak=peak, warmup=warmup, total=total),
                                                   rel=1e-5, abs=1e-9), h
    assert history[0]["learning_rate"] < peak  # the first epoch ended inside the warmup
    assert metrics["optimizer_updates"] == 3 * steps
    _assert_trains(metrics)


def test_accumulation_pushes_once_per_k_micro_batches(shards, s3_prefix, tmp_path, caplog):
    """k=2 micro-batches of 16 per optimizer step on 2 dist_sync workers: the job takes as many
    optimizer steps (trainer.step = one pushpull per parameter through the servers) as a job
    with batch 32, twice as many micro-batches, and the optimizer counts one update per step."""
    cfg, _, manifest = shards
    job, metrics, _ = _train(shards, s3_prefix, tmp_path, caplog,
                             optim={"batch_size": 16, "accumulate_steps": 2, "optimizer": "lamb",
                                    "learning_rate": 0.01})
    steps = _steps_per_epoch(manifest, 2, 32)
    assert metrics["global_step"] == metrics["optimizer_steps"] == metrics["optimizer_updates"] == 2 * steps
    assert metrics["micro_batches"] == 2 * metrics["optimizer_steps"]
    _assert_trains(metrics)


def test_two_bit_compression_on_dist_sync_trains(shards, s3_prefix, tmp_path, caplog):
    """The default threshold on standardised features (data.standardize, on for tables): the
    job trains. Measured with benchmarks/compression_accuracy.py --epochs 2 (deterministic):
    0.916 at threshold 0.5 against 0.877 uncompressed; 0.866 at 2, 0.765 at 8, 0.408 at 32. On
    the raw pixel values (0-16) the same threshold stayed at 0.33 (docs/kvstore-correctness.md):
    the threshold is compared with the unscaled gradient, which standardised inputs keep small."""
    job, metrics, _ = _train(shards, s3_prefix, tmp_path, caplog,
                             cluster={"gradient_compression": "2bit", "compression_threshold": 0.5})
    _assert_trains(metrics, min_accuracy=0.8)
    assert len(re.findall(r"2-bit gradient compression on \(threshold 0.5\)", caplog.text)) == 2


def test_two_bit_pushes_carry_mxnets_quantisation(tmp_path):
    """The engine's compressing view (push then pull) in a real 2-worker dist_sync job: every
    pull returns the sum of both workers' quantised gradients, with each worker's residual
    carried to its next push, exactly as the algorithm written out here."""
    from testkit.ps_cluster import run_script_job

    from tests.integration import compression_probe_worker as probe

    out, steps, t, seed = str(tmp_path / "out"), 6, 0.5, 5
    run_script_job([sys.executable, probe.__file__, "--steps", str(steps), "--threshold", str(t), "--seed",
                    str(seed), "--out", out], num_workers=2, num_servers=1, record_dir=str(tmp_path / "procs"),
                   timeout_s=180.0)
    got = [np.load(os.path.join(out, f"rank{r}.npz")) for r in range(2)]
    for key, shape in enumerate(probe.SHAPES):
        residuals = [np.zeros(shape, np.float32) for _ in range(2)]
        for step in range(steps):
            expected = sum(_two_bit(residuals[r], probe.gradient(seed, r, step, shape), t) for r in range(2))
            for r in range(2):
                np.testing.assert_array_equal(got[r][f"k{key}-s{step}"], expected, err_msg=f"key {key} step {step}")
        assert np.count_nonzero(expected) > 0  # the probe's gradients do cross the threshold


SPLIT = {"model": {"placement": "split"}, "cluster": {"devices_per_worker": 2}}


def _final_checkpoint(job):
    ckpt = store_for(job.checkpoint_prefix, job.config.checkpoint).latest()
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return ckpt, {k: arrays[k].copy() for k in arrays.files}


@pytest.fixture(scope="module")
def split_run(shards, s3_server, tmp_path_factory):
    """One uninterrupted split-model job (2 dist_sync workers, the MLP over cpu(0) and cpu(1)):
    its metrics, the launcher's log of it and its final checkpoint. The split tests share it."""
    prefix = f"s3://{s3_server.bucket}/test-engine-split-{os.getpid()}"
    job = make_job(shards[0], shards[1], prefix, **SPLIT)
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    launcher = logging.getLogger("training.launch.launcher")
    old_level = launcher.level
    launcher.addHandler(handler)
    launcher.setLevel(logging.INFO)
    try:
        run_job(job, prefix, tmp_path_factory.mktemp("split"))
    finally:
        launcher.removeHandler(handler)
        launcher.setLevel(old_level)
    return job, json.loads(storage.get_bytes(job.metrics_uri)), "\n".join(lines), _final_checkpoint(job)


def test_model_split_over_contexts_with_data_parallel_workers(split_run):
    """Hybrid parallelism: 2 dist_sync workers (data parallel through the servers), each holding
    the MLP split over cpu(0) and cpu(1) (model parallel: each layer's parameters on one context
    only). It trains, both workers report the split, the exported model is one network, and the
    checkpoints hold both stages' optimizer state."""
    job, metrics, log_text, (ckpt, _) = split_run
    _assert_trains(metrics)
    splits = re.findall(r"model split over 2 contexts: (.*)", log_text)
    assert len(splits) == 2, log_text[-3000:]
    stage0, stage1 = splits[0].split(" | ")
    assert stage0.startswith("cpu(0): ") and "@cpu(1)" not in stage0
    assert stage1.startswith("cpu(1): ") and "@cpu(0)" not in stage1
    assert metrics["optimizer_updates"] == metrics["global_step"]
    names = sorted(u.rsplit("/", 1)[1] for u in storage.list_uris(job.model_prefix))
    assert names == ["model-0000.params", "model-symbol.json", "model_meta.json", "preprocessing.json"]
    assert ckpt.step == metrics["global_step"] and ckpt.state["optimizer_state"]
    assert sorted(ckpt.files) == ["params.npz", "trainer-stage0.states", "trainer-stage1.states"]
    assert ckpt.state["optimizer_stages"] == [["0.bias", "0.weight"], ["1.bias", "1.weight"]]


def test_split_model_resumes_exactly_after_sigterm(shards, split_run, s3_prefix, tmp_path, caplog):
    """Exact resume for a split model: SIGTERM to rank 0 mid-epoch (step 27, off the checkpoint
    cadence) writes an emergency checkpoint with every stage's optimizer state; the retry
    restores it and ends with the uninterrupted job's parameters bit for bit."""
    _, metrics, _, (_, reference) = split_run
    # No restart in place: the preempted job ends and the next one (the retry's) resumes.
    job = make_job(shards[0], shards[1], s3_prefix, **{**SPLIT, "cluster": {**SPLIT["cluster"],
                                                                            "max_restarts_without_progress": 0}})
    with pytest.raises(JobFailed) as failed:
        run_job(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_TERM_STEP": "27", "MXPIPE_FAULT_KILL_RANK": "0"})
    assert failed.value.exit_code == EXIT_PREEMPTED, str(failed.value)
    assert store_for(job.checkpoint_prefix, job.config.checkpoint).committed_steps()[0] == 27
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    caplog.clear()
    run_job(job, s3_prefix, tmp_path)
    resumed = re.findall(r"resumed from step (\d+) .*optimizer state (\w+)", caplog.text)
    assert [r for r in resumed] == [("27", "restored")] * 2, caplog.text[-3000:]
    ckpt, params = _final_checkpoint(job)
    assert ckpt.step == metrics["global_step"] and sorted(params) == sorted(reference)
    diff = max(float(np.max(np.abs(params[k] - reference[k]))) for k in reference)
    print(f"split model: max |resumed - uninterrupted| = {diff:.3g}")
    assert all(np.array_equal(params[k], reference[k]) for k in reference), diff


def test_learning_rate_follows_warmup_then_cosine_at_every_step():
    """Step by step, in this process: the rate the engine's optimizer applied at each update
    (learning_rate_at after the step) is the written-out schedule at that global step, also for
    a trainer rebuilt at a later step (what a resume does) and with accumulation (k=2 micro-
    batches still count as one step)."""
    from common.mx import import_mxnet
    from training.loop.kvstore_sync import make_trainer
    from training.loop.optim import learning_rate_at, optimizer_params
    from training.loop.step import StepRunner, prepare

    mx = import_mxnet()
    steps_per_epoch, epochs, warmup, peak = 4, 3, 5, 0.02
    cfg = recipe("debug").replace(cluster={"kvstore": "local", "num_workers": 1},
                                  optim={"optimizer": "sgd", "learning_rate": peak, "epochs": epochs,
                                         "lr_schedule": "cosine", "warmup_steps": warmup, "batch_size": 8,
                                         "accumulate_steps": 2})
    total = steps_per_epoch * epochs
    rng = np.random.RandomState(0)
    X, y = rng.randn(16, 4).astype(np.float32), rng.randint(0, 2, 16).astype(np.float32)

    def run_from(start: int) -> list[float]:
        net = mx.gluon.nn.Dense(2, in_units=4)
        net.initialize()
        trainer = make_trainer(net.collect_params(), "sgd", optimizer_params(cfg, 1, steps_per_epoch, start),
                               mx.kv.create("local"), "workers", batch_size=16)
        prepare(net, trainer, 2, use_amp=False)
        step = StepRunner(net, trainer, mx.gluon.loss.SoftmaxCrossEntropyLoss(), [mx.cpu()], batch_size=8,
                          accumulate_steps=2, global_batch=16)
        seen = []
        for _ in range(start, total):
            step(X, y, np.arange(16))
            seen.append(learning_rate_at(trainer))
        return seen

    expected = [_lr_at(g + 1, peak=peak, warmup=warmup, total=total) for g in range(total)]
    assert run_from(0) == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert run_from(7) == pytest.approx(expected[7:], rel=1e-5, abs=1e-9)


def test_split_model_computes_what_the_unsplit_model_computes():
    """Reference for model.placement='split', in this process on a local kvstore: an MLP split
    over cpu(0)/cpu(1) with per-stage trainers, started from the same parameters as the same
    MLP on one context, ends 6 Adam steps (k=2 accumulation) with the same parameters up to
    float32 noise; and each stage's parameters exist on its own context only."""
    from common.mx import import_mxnet
    from training.loop.kvstore_sync import make_trainer
    from training.loop.model import build_model
    from training.loop.optim import optimizer_params
    from training.loop.placement import SplitNet, make_split_trainer
    from training.loop.step import StepRunner, prepare

    mx = import_mxnet()
    cfg = recipe("debug").replace(cluster={"kvstore": "local", "num_workers": 1, "devices_per_worker": 2},
                                  model={"hidden": (16, 8), "placement": "split"},
                                  optim={"batch_size": 8, "accumulate_steps": 2, "learning_rate": 0.01})
    ctxs = [mx.cpu(0), mx.cpu(1)]
    rng = np.random.RandomState(3)
    X, y = rng.randn(16, 6).astype(np.float32), rng.randint(0, 3, 16).astype(np.float32)

    def trained(split: bool) -> dict[str, np.ndarray]:
        mx.random.seed(5)
        net = build_model(cfg, 3)
        if split:
            net = SplitNet(net, ctxs)
        net.initialize(mx.init.Xavier(), ctx=ctxs if split else ctxs[:1])
        net(mx.nd.zeros((1, 6)))
        init = np.random.RandomState(9)
        for p in net.collect_params().values():  # the same start for both, whatever the init order
            p.set_data(mx.nd.array(init.standard_normal(p.shape) * 0.3))
        params = lambda: optimizer_params(cfg, 1, 10, 0)  # noqa: E731
        if split:
            assert [{str(c) for p in stage for c in p.list_ctx()} for stage in net.stage_params()] == \
                [{"cpu(0)"}, {"cpu(1)"}]
            trainer = make_split_trainer(net, "adam", params, mx.kv.create("local"), batch_size=16)
        else:
            trainer = make_trainer(net.collect_params(), "adam", params(), mx.kv.create("local"), "workers",
                                   batch_size=16)
        prepare(net, trainer, 2, use_amp=False)
        step = StepRunner(net, trainer, mx.gluon.loss.SoftmaxCrossEntropyLoss(), ctxs[:1], batch_size=8,
                          accumulate_steps=2, global_batch=16)
        start = {name: p.list_data()[0].asnumpy() for name, p in net._collect_params_with_prefix().items()}
        for _ in range(6):
            step(X, y, np.arange(16))
        end = {name: p.list_data()[0].asnumpy() for name, p in net._collect_params_with_prefix().items()}
        return start, end

    (start, plain), (start_split, split) = trained(False), trained(True)
    assert plain.keys() == split.keys() and len(plain) == 6
    for name in plain:
        np.testing.assert_array_equal(start_split[name], start[name])
        assert np.abs(plain[name] - start[name]).max() > 1e-3, name  # it did train
        np.testing.assert_allclose(split[name], plain[name], rtol=1e-5, atol=1e-6, err_msg=name)
