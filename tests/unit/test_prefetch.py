"""The prefetching batch feed: the inline sequence at any depth, errors named, no thread left."""
from __future__ import annotations

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import threading
import time

import numpy as np
import pytest

from common.config import ConfigError, DataConfig, TrainConfig
from training.feed.data import EpochOrder
from testkit.waits import wait_for
from training.feed.prefetch import PrefetchError, prefetched

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(5)
X = RNG.normal(size=(37, 4)).astype(np.float32)
Y = RNG.integers(0, 3, 37).astype(np.int32)


def gather(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return X[rows], Y[rows]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetch")]


def step_runner(k: int, batch: int, num_ctx: int):
    from common.mx import import_mxnet
    from training.loop.step import StepRunner

    mx = import_mxnet()
    ctxs = [mx.cpu(i) for i in range(num_ctx)]
    net = mx.gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    return mx, ctxs, net, lambda trainer: StepRunner(net, trainer, mx.gluon.loss.SoftmaxCrossEntropyLoss(), ctxs,
                                                     batch_size=batch, accumulate_steps=k, global_batch=batch * k)


@pytest.mark.parametrize("start_step, k, num_ctx, depth", [(0, 1, 1, 2), (3, 2, 2, 1), (5, 4, 1, 3), (1, 2, 3, 2)])
def test_prefetched_batches_equal_the_inline_ones_in_order(start_step, k, num_ctx, depth):
    batch = 6
    _, ctxs, _, make = step_runner(k, batch, num_ctx)
    runner = make(None)
    order = EpochOrder(num_rows=len(Y), steps=9, batch_size=batch * k, seed=11, rank=1)
    inline = list(prefetched(order.batches(2, start_step), lambda ix: runner.load(gather, ix), 0))
    ahead = list(prefetched(order.batches(2, start_step), lambda ix: runner.load(gather, ix), depth, label="epoch 2"))
    assert [s for s, _, _ in ahead] == [s for s, _, _ in inline] == list(range(start_step, 9))
    for (_, i1, b1), (_, i2, b2) in zip(inline, ahead):
        np.testing.assert_array_equal(i1, i2)
        assert len(b1) == len(b2) == k
        for (xs1, ys1), (xs2, ys2) in zip(b1, b2):
            assert [a.context for a in xs2] == [a.context for a in ys2] == ctxs
            for a, b in zip(xs1 + ys1, xs2 + ys2):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    assert not prefetch_threads()


def test_training_through_the_thread_gives_the_inline_parameters_bit_for_bit():
    """NDArrays made in the prefetch thread while the main thread records and steps (MXNet 1.9, CPU)."""
    results = []
    for depth in (0, 3):
        mx, ctxs, net, make = step_runner(k=2, batch=4, num_ctx=2)
        mx.random.seed(0)
        net.initialize(mx.init.Xavier(), ctx=ctxs, force_reinit=True)
        trainer = mx.gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05}, kvstore="device",
                                   update_on_kvstore=False)
        from training.loop.step import prepare

        prepare(net, trainer, 2, False)
        runner = make(trainer)
        order = EpochOrder(num_rows=len(Y), steps=5, batch_size=8, seed=1, rank=0)
        losses = []
        for epoch in range(3):
            for _, _, batch in prefetched(order.batches(epoch), lambda ix: runner.load(gather, ix), depth):
                losses.append(runner.run_batch(batch))
        mx.nd.waitall()
        results.append(([float(l.asscalar()) for l in losses],
                        [p.data(ctxs[0]).asnumpy() for p in net.collect_params().values()]))
    (l0, p0), (l3, p3) = results
    assert l0 == l3
    assert len(p0) == len(p3) == 2
    for a, b in zip(p0, p3):
        np.testing.assert_array_equal(a, b)
    assert not prefetch_threads()


@pytest.mark.parametrize("depth", [0, 2])
def test_a_failed_load_is_raised_in_the_loop_naming_the_step(depth):
    def load(ix: np.ndarray) -> np.ndarray:
        if seen and len(seen) == 4:
            raise OSError("disk went away")
        seen.append(ix)
        return ix

    seen: list[np.ndarray] = []
    order = EpochOrder(num_rows=20, steps=8, batch_size=2, seed=0, rank=0)
    got = []
    with pytest.raises(PrefetchError, match=r"step 4 of epoch 7 failed: OSError: disk went away") as info:
        for step, _, _ in prefetched(order.batches(7), load, depth, label="epoch 7"):
            got.append(step)
    assert info.value.step == 4 and isinstance(info.value.__cause__, OSError)
    assert got == [0, 1, 2, 3]
    assert not prefetch_threads()


def test_the_thread_is_gone_after_the_epoch_and_after_an_early_break():
    order = EpochOrder(num_rows=30, steps=50, batch_size=3, seed=0, rank=0)
    for _ in range(3):  # one thread per epoch, none left behind
        assert len(list(prefetched(order.batches(0), lambda ix: ix, 2))) == 50
        assert not prefetch_threads()
    for step, _, _ in prefetched(order.batches(1), lambda ix: ix, 4, label="epoch 1"):
        assert [t.name for t in prefetch_threads()] == ["prefetch epoch 1"]
        if step == 2:
            break
    assert not prefetch_threads()


def test_the_thread_stays_at_most_depth_batches_ahead():
    loaded: list[int] = []
    order = EpochOrder(num_rows=30, steps=20, batch_size=3, seed=0, rank=0)
    feed = prefetched(order.batches(0), lambda ix: loaded.append(1) or ix, 3)
    next(feed)
    # The thread runs ahead until it blocks on the full queue: then it has loaded the one taken,
    # a full queue and one waiting to be put, and no more.
    wait_for(lambda: len(loaded) >= 1 + 3 + 1, timeout_s=30, what="the prefetch thread ahead")
    assert len(loaded) <= 1 + 3 + 1  # the one taken, a full queue, one waiting to be put
    feed.close()
    assert not prefetch_threads()


def test_a_stuck_reader_is_an_error_not_a_stall():
    def slow(ix: np.ndarray) -> np.ndarray:
        time.sleep(1.0)
        return ix

    order = EpochOrder(num_rows=10, steps=3, batch_size=2, seed=0, rank=0)
    started = time.monotonic()
    with pytest.raises(PrefetchError, match="no batch after step None of epoch 0 within 0 s"):
        for _ in prefetched(order.batches(0), slow, 1, label="epoch 0", wait_s=0.3):
            pass
    assert time.monotonic() - started < 5
    assert not prefetch_threads()


def test_prefetch_depth_is_validated_and_does_not_change_the_resume_digest():
    with pytest.raises(ConfigError, match=r"data.prefetch_batches must be an integer in \[0, 64\]"):
        DataConfig(prefetch_batches=-1)
    with pytest.raises(ConfigError, match="prefetch_batches"):
        DataConfig(prefetch_batches=1.5)  # type: ignore[arg-type]
    from training.loop.worker import resume_digest

    assert resume_digest(TrainConfig(data=DataConfig(prefetch_batches=0))) == resume_digest(TrainConfig())
