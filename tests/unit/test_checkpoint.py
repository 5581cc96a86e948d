import json
import os

import pytest

from common import storage
from tests.unit.checkpoint_support import hold_uploads, snapshot_at
from training.checkpoint.store import CheckpointStore, CorruptCheckpoint

pytestmark = pytest.mark.unit


def _save(store, step):
    return store.save(step, {"model.params": f"params-{step}".encode()}, {"global_step": step})


def test_latest_returns_newest_committed(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    for step in (10, 20, 30):
        _save(store, step)
    ckpt = store.latest()
    assert ckpt.step == 30
    assert ckpt.files["model.params"] == b"params-30"
    assert ckpt.state == {"global_step": 30}


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    _save(store, 10)
    # A writer that died after the data files but before the manifest.
    storage.put_bytes(storage.join(store.step_uri(20), "model.params"), b"half")
    assert store.steps() == [20, 10]
    assert store.committed_steps() == [10]
    assert store.latest().step == 10


def test_corrupt_checkpoint_is_skipped(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    _save(store, 10)
    _save(store, 20)
    path = store.file_uri(20, "model.params")
    with open(path, "wb") as fh:
        fh.write(b"params-2X")  # same size, different bytes
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        store.load(20)
    assert store.latest().step == 10


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert CheckpointStore(str(tmp_path / "none"), keep=2).latest() is None


def test_retention_keeps_newest_k_and_deletes_only_after_commit(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (10, 20, 30, 40):
        _save(store, step)
    assert store.committed_steps() == [40, 30]
    assert store.steps() == [40, 30]


def test_recommit_of_same_step_keeps_the_first(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    _save(store, 10)
    manifest = json.loads(storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")))
    _save(store, 10)  # a resumed attempt reaching the same step again
    again = json.loads(storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")))
    assert again == manifest


def test_keep_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), keep=1)


# -- retention with permanent checkpoints -------------------------------------------------------


def test_keep_every_n_steps_keeps_the_oldest_of_each_window(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2, keep_every_n_steps=100)
    for step in (30, 60, 90, 120, 150, 180, 210, 240):
        _save(store, step)
    # newest 2 (240, 210) + the oldest committed of windows [0,100), [100,200), [200,300)
    assert store.committed_steps() == [240, 210, 120, 30]
    assert store.steps() == [240, 210, 120, 30]


# -- client-side envelope encryption ------------------------------------------------------------

KEY = "11" * 32


def _enc_store(path, key=KEY, env="MXPIPE_TEST_CKPT_KEY"):
    from training.checkpoint.crypto import Envelope, parse_key

    return CheckpointStore(str(path), keep=2, envelope=Envelope(parse_key(key, env), env))


def test_encrypted_checkpoint_roundtrips_and_is_unreadable_at_rest(tmp_path):
    store = _enc_store(tmp_path)
    store.save(10, {"model.params": b"secret-params" * 10}, {"global_step": 10})
    raw = storage.get_bytes(store.file_uri(10, "model.params"))
    assert b"secret-params" not in raw
    manifest = json.loads(storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")))
    assert manifest["encryption"]["algorithm"].startswith("AES-256-GCM")
    assert KEY not in json.dumps(manifest)
    ckpt = store.latest()
    assert ckpt.files["model.params"] == b"secret-params" * 10 and ckpt.state == {"global_step": 10}


def test_wrong_or_missing_key_fails_with_the_checkpoint_named(tmp_path):
    from training.checkpoint.store import CheckpointKeyError

    _enc_store(tmp_path).save(10, {"model.params": b"x"}, {"global_step": 10})
    with pytest.raises(CheckpointKeyError, match=r"step-00000010.*another key.*MXPIPE_TEST_CKPT_KEY"):
        _enc_store(tmp_path, key="22" * 32).latest()  # not skipped, not a fresh start
    with pytest.raises(CheckpointKeyError, match="encrypted but no key"):
        CheckpointStore(str(tmp_path), keep=2).latest()
    assert issubclass(CheckpointKeyError, ValueError)  # the worker maps it to EXIT_BAD_INPUT


def test_swapped_ciphertext_files_fail_to_decrypt(tmp_path):
    from training.checkpoint.store import CheckpointKeyError

    store = _enc_store(tmp_path)
    store.save(10, {"a": b"aaaa", "b": b"bbbb"}, {"global_step": 10})
    base = store.step_uri(10)
    # The manifest names each file's path: pointing "a" at b's ciphertext (and b at a's) is the swap.
    manifest = json.loads(storage.get_bytes(storage.join(base, "MANIFEST.json")))
    manifest["files"]["a"], manifest["files"]["b"] = manifest["files"]["b"], manifest["files"]["a"]
    os.remove(storage.join(base, "MANIFEST.json"))
    storage.put_bytes(storage.join(base, "MANIFEST.json"), json.dumps(manifest).encode())
    with pytest.raises(CheckpointKeyError, match="decryption failed"):
        store.load(10)


def test_key_from_env_rejects_bad_values(monkeypatch):
    from training.checkpoint.crypto import CheckpointKeyError, key_from_env

    monkeypatch.delenv("MXPIPE_NOKEY", raising=False)
    with pytest.raises(CheckpointKeyError, match="not set"):
        key_from_env("MXPIPE_NOKEY")
    monkeypatch.setenv("MXPIPE_SHORTKEY", "abcd")
    with pytest.raises(CheckpointKeyError, match="32-byte") as err:
        key_from_env("MXPIPE_SHORTKEY")
    assert "abcd" not in str(err.value)
    import base64

    monkeypatch.setenv("MXPIPE_B64KEY", base64.b64encode(b"k" * 32).decode())
    assert key_from_env("MXPIPE_B64KEY") == b"k" * 32


# -- the background writer ----------------------------------------------------------------------


def test_async_writer_waits_for_the_upload_in_flight(tmp_path, monkeypatch):
    import threading

    from training.checkpoint.uploader import CheckpointUploader

    store = CheckpointStore(str(tmp_path), keep=5)
    gate = hold_uploads(store, monkeypatch)
    writer = CheckpointUploader(store, asynchronous=True)
    writer.submit(snapshot_at(10))
    assert writer.busy
    threading.Timer(0.3, gate.set).start()
    writer.submit(snapshot_at(30))  # waits for step 10, then goes (skipping is the manager's: test_checkpoint_manager)
    writer.close(deadline=None)
    assert writer.stats.waited == 1 and writer.stats.steps == [10, 30]
    assert store.committed_steps() == [30, 10]
    ckpt = store.latest()
    assert set(ckpt.files) == {"params.npz", "trainer.states"}


def test_async_writer_retries_storage_errors_with_backoff(tmp_path, monkeypatch):
    from training.checkpoint import uploader as checkpoint_async
    from training.checkpoint.uploader import CheckpointUploader

    monkeypatch.setattr(checkpoint_async, "BACKOFF_FIRST_S", 0.01)
    store = CheckpointStore(str(tmp_path), keep=3)
    failures = iter([storage.StorageError("s3 down"), ConnectionError("refused")])
    real_put = storage.put_bytes

    def flaky_put(uri, data, **kw):
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return real_put(uri, data, **kw)

    monkeypatch.setattr(storage, "put_bytes", flaky_put)
    writer = CheckpointUploader(store, asynchronous=True, upload_timeout_s=10)
    writer.submit(snapshot_at(5))
    writer.close()
    assert writer.stats.retries == 2 and writer.stats.committed == 1 and store.committed_steps() == [5]


def test_async_writer_gives_up_after_its_timeout(tmp_path, monkeypatch):
    from training.checkpoint import uploader as checkpoint_async
    from training.checkpoint.uploader import CheckpointUploader

    monkeypatch.setattr(checkpoint_async, "BACKOFF_FIRST_S", 0.05)

    def dead_put(uri, data, **kw):
        raise storage.StorageError("s3 down")

    monkeypatch.setattr(storage, "put_bytes", dead_put)
    writer = CheckpointUploader(CheckpointStore(str(tmp_path), keep=3), asynchronous=True, upload_timeout_s=0.3)
    writer.submit(snapshot_at(5))
    writer.close(deadline=None)
    assert writer.stats.failed == 1 and writer.stats.committed == 0 and writer.stats.retries >= 1


def test_async_writer_sees_an_unreachable_s3_within_seconds_and_retries_with_backoff(monkeypatch):
    """Every failed attempt reaches the writer (logged, counted, retried with its backoff):
    botocore's own retries would otherwise spend 12-31 s inside one attempt on a refused
    connection, long enough to ride out a short outage without a failure ever being seen."""
    import socket
    import time

    from training.checkpoint import uploader as checkpoint_async
    from training.checkpoint.uploader import CheckpointUploader

    with socket.socket() as probe:  # a loopback port nothing listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k",
                       "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(checkpoint_async, "BACKOFF_FIRST_S", 0.5)
    with storage.fail_fast():
        storage.s3_client()  # built before the clock starts: seconds on a loaded machine
    writer = CheckpointUploader(CheckpointStore("s3://down/ckpt", keep=3), asynchronous=True, upload_timeout_s=6)
    started = time.monotonic()
    writer.submit(snapshot_at(5))
    writer.close(deadline=None)
    assert writer.stats.retries >= 2 and writer.stats.failed == 1 and writer.stats.committed == 0
    assert time.monotonic() - started < 12


def test_step_seed_depends_on_seed_step_and_rank():
    from training.checkpoint.state import step_seed

    seeds = {step_seed(s, g, r) for s in (1, 2) for g in (0, 1, 2) for r in (0, 1)}
    assert len(seeds) == 12 and all(0 <= x < 2**31 for x in seeds)
    assert step_seed(42, 7, 0) == step_seed(42, 7, 0)


def test_checkpoint_config_validates_new_fields():
    from common.config import CheckpointConfig, ConfigError

    CheckpointConfig(sse="aws:kms", sse_kms_key_id="alias/x", encryption_key_env="MXPIPE_KEY", every_n_seconds=30)
    for bad in ({"sse": "DES"}, {"sse_kms_key_id": "k"}, {"every_n_seconds": -1}, {"keep_every_n_steps": -1},
                {"encryption_key_env": "00" * 32 + "=="}, {"encryption_key_env": "11" * 32}, {"preempt_grace_s": 0}):
        with pytest.raises(ConfigError):
            CheckpointConfig(**bad)


def test_sse_args():
    assert storage.sse_args("") == {}
    assert storage.sse_args("AES256") == {"ServerSideEncryption": "AES256"}
    assert storage.sse_args("aws:kms", "k1") == {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "k1"}
    with pytest.raises(ValueError):
        storage.sse_args("nope")


def test_snapshot_holds_the_values_of_its_step_while_training_goes_on():
    """The snapshot only queues engine copies; later updates must not leak into it, and its
    optimizer bytes must restore like Trainer.save_states' (update counts included)."""
    import numpy as np

    from common.mx import import_mxnet
    from training.checkpoint import state as cs
    from training.loop.kvstore_sync import make_trainer

    mx = import_mxnet()
    mx.random.seed(3)
    net = mx.gluon.nn.Dense(4, in_units=8)
    net.initialize(mx.init.Xavier())
    trainer = make_trainer(net.collect_params(), "adam", {"learning_rate": 0.1}, mx.kv.create("local"),
                           "workers", batch_size=4)
    x, y = mx.nd.ones((4, 8)), mx.nd.array([0, 1, 2, 3])
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    def step():
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(4)

    for _ in range(3):
        step()
    expected_w = net.weight.data().asnumpy()
    expected_states = trainer._updaters[0].get_states(dump_optimizer=True)
    snap = cs.snapshot(net, trainer, 3, {"history": [1]})
    for _ in range(5):  # runs on while the snapshot is pending
        step()
    files = snap.files()
    with np.load(__import__("io").BytesIO(files[cs.PARAMS])) as arrays:
        np.testing.assert_array_equal(arrays["weight"], expected_w)
    assert not np.array_equal(net.weight.data().asnumpy(), expected_w)

    fresh = make_trainer(net.collect_params(), "adam", {"learning_rate": 0.1}, mx.kv.create("local"),
                         "workers", batch_size=4)
    assert cs.load_states(fresh, files[cs.STATES], "snapshot")
    ref = make_trainer(net.collect_params(), "adam", {"learning_rate": 0.1}, mx.kv.create("local"),
                       "workers", batch_size=4)
    assert cs.load_states(ref, expected_states, "reference")
    got, want = fresh._updaters[0], ref._updaters[0]
    assert got.optimizer.num_update == want.optimizer.num_update == 3
    for key, (mean, var) in want.states.items():
        np.testing.assert_array_equal(got.states[key][0].asnumpy(), mean.asnumpy())
        np.testing.assert_array_equal(got.states[key][1].asnumpy(), var.asnumpy())


def _split_mlp(num_ctxs, begin_num_update=0):
    """The debug MLP (3 Dense blocks) split over cpu(0..n-1), per-stage Adam on a local kvstore."""
    from common.mx import import_mxnet
    from common.config import recipe
    from training.loop.model import build_model
    from training.loop.placement import SplitNet, make_split_trainer

    mx = import_mxnet()
    cfg = recipe("debug").replace(model={"hidden": (16, 8)})
    mx.random.seed(5)
    net = SplitNet(build_model(cfg, 3), [mx.cpu(i) for i in range(num_ctxs)])
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 6)))
    trainer = make_split_trainer(net, "adam", lambda: {"learning_rate": 0.01, "begin_num_update": begin_num_update},
                                 mx.kv.create("local"), batch_size=8)
    return net, trainer


def _split_steps(net, trainer, n):
    import numpy as np

    from common.mx import import_mxnet

    mx = import_mxnet()
    rng = np.random.RandomState(1)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(n):
        x, y = mx.nd.array(rng.randn(8, 6)), mx.nd.array(rng.randint(0, 3, 8))
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
    return {name: p.list_data()[0].asnumpy() for name, p in net._collect_params_with_prefix().items()}


def test_split_model_checkpoint_holds_every_stage_and_resumes_exactly():
    """A split model's snapshot holds each stage's Trainer.save_states bytes and the stage layout;
    restored into a fresh split model (same stages) the next steps are bit-identical to going on,
    and with another split (3 stages instead of 2) the states move by parameter name."""
    import numpy as np

    from common.mx import import_mxnet
    from training.checkpoint import state as cs

    mx = import_mxnet()
    net, trainer = _split_mlp(2)
    _split_steps(net, trainer, 3)
    snap = cs.snapshot(net, trainer, 3, {"global_step": 3})
    files = snap.files()
    assert set(files) == {cs.PARAMS, "trainer-stage0.states", "trainer-stage1.states"}
    assert snap.state["optimizer_state"] is True
    assert snap.state["optimizer_stages"] == [["0.bias", "0.weight", "1.bias", "1.weight"], ["2.bias", "2.weight"]]
    assert snap.nbytes > sum(a.size * 4 for a in snap.params.values())  # the stages' moments count too
    # Rank 0's state goes into state.json: it must be JSON.
    assert json.loads(json.dumps(snap.state)) == snap.state
    continued = {}
    for label, num_ctxs, begin in (("same", 2, 0), ("resplit", 3, 3)):
        fresh, fresh_trainer = _split_mlp(num_ctxs, begin_num_update=begin)
        cs.load_params(fresh, files[cs.PARAMS], mx.cpu(0))
        assert cs.restore_optimizer(fresh_trainer, fresh, files, snap.state, "snapshot")
        assert [t._optimizer.num_update for t in fresh_trainer.trainers] == [3] * num_ctxs
        continued[label] = _split_steps(fresh, fresh_trainer, 4)
    # The reference: the original model going on for the same 4 batches after its snapshot.
    reference = _split_steps(net, trainer, 4)
    for name, want in reference.items():
        np.testing.assert_array_equal(continued["same"][name], want, err_msg=name)
        np.testing.assert_allclose(continued["resplit"][name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    # Without the restored moments Adam would have gone elsewhere (the check above is not vacuous).
    cold, cold_trainer = _split_mlp(2, begin_num_update=3)
    cs.load_params(cold, files[cs.PARAMS], mx.cpu(0))
    cold_end = _split_steps(cold, cold_trainer, 4)
    assert max(float(np.abs(cold_end[n] - reference[n]).max()) for n in reference) > 1e-4


def test_split_checkpoint_without_stage_states_restarts_the_optimizer_and_replicated_layout_is_unchanged(caplog):
    """A split-model checkpoint from before stage states (optimizer_state false, no stage files)
    still loads, with the optimizer from zero (logged); a replicated model's snapshot keeps its
    one trainer.states file and no stage layout."""
    from common.mx import import_mxnet
    from training.checkpoint import state as cs
    from training.loop.kvstore_sync import make_trainer

    mx = import_mxnet()
    net, trainer = _split_mlp(2)
    _split_steps(net, trainer, 1)
    old_files = {cs.PARAMS: cs.snapshot(net, trainer, 1, {}).files()[cs.PARAMS]}
    assert not cs.restore_optimizer(trainer, net, old_files, {"optimizer_state": False}, "old-ckpt")
    assert "optimizer state restarts from zero: old-ckpt holds none" in caplog.text

    dense = mx.gluon.nn.Dense(4, in_units=8)
    dense.initialize()
    plain = make_trainer(dense.collect_params(), "adam", {"learning_rate": 0.1}, mx.kv.create("local"), "workers",
                         batch_size=4)
    snap = cs.snapshot(dense, plain, 0, {"global_step": 0})
    assert set(snap.files()) == {cs.PARAMS, cs.STATES}
    assert snap.state == {"global_step": 0, "optimizer_state": True}
    assert cs.restore_optimizer(plain, dense, snap.files(), snap.state, "replicated")
