"""One role of a kvstore reference job: trains K independent tiny models and saves what it got.

Run by ``test_kvstore_reference.py`` as a worker process of a real ps-lite job (``DMLC_*`` set
by the launcher), or as a plain process (no ``DMLC_*``) for the single-process kvstores; with
``--kvstore dist_async`` it runs ``run_async_checks`` instead. Everything that defines a trial
(initial parameters, every step's global batch) is a pure function of ``(seed, trial, step)``,
so the single-process reference in the test can recompute it.

Each trial uses a fresh model and fresh kvstore keys (``training.loop.kvstore_sync.with_key_offset`` shifts a trainer's keys by
``trial * KEY_STRIDE``), so K trials run back to back inside one job launch, each starting from
an empty server-side state: the repetitions that catch a race cost one cluster start-up.

A worker whose rank is not 0 starts every trial from deliberately wrong parameters: a
correct kvstore mode must overwrite them with rank 0's values before the first update, so the
initial parameter sync is under test too.

With ``--placement split`` the model is split over the worker's contexts the way the pipeline
does it (``training.loop.placement``: ``SplitNet``, one Trainer per stage from
``make_split_trainer`` on key-shifted views of the trial's view); the batch then enters whole
on the first context. The reference stays one unsplit process.

``--net custom`` trains the user's network of ``testkit/custom_nets.py`` (built by
``training.loop.custom_model``), ``--features preprocessed`` a raw table's rows through the
pipeline's table preprocessing: the same reference holds with either.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common.mx import import_mxnet  # noqa: E402
from training.loop.kvstore_sync import with_gradient_compression, with_key_offset  # noqa: E402

IN_UNITS, HIDDEN, CLASSES = 10, 16, 4
KEY_STRIDE = 100
# ``--net custom``: the user's network of testkit/custom_nets.py, its folder on the path (``--code-dir``).
CUSTOM_NET = "mynet.arch:build"


def build_net(mx: Any, prefix: str, kind: str = "mlp") -> Any:
    if kind == "custom":  # built the pipeline's way; its own prefix, its Dense layers' inputs deferred
        from common.config import ModelConfig
        from training.loop.custom_model import build_block

        return build_block(ModelConfig(name=CUSTOM_NET, options={"width": HIDDEN}), CLASSES, (IN_UNITS,))
    nn = mx.gluon.nn
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(HIDDEN, activation="relu", in_units=IN_UNITS))
        net.add(nn.Dense(HIDDEN, activation="relu", in_units=HIDDEN))
        net.add(nn.Dense(CLASSES, in_units=HIDDEN))
    return net


def initialize(mx: Any, net: Any, ctxs: list[Any]) -> None:
    """Allocate the parameters on ``ctxs``; one forward pass settles deferred shapes (a custom
    network's), so the trial's values can be set before any step."""
    net.initialize(ctx=ctxs)
    net(mx.nd.zeros((1, IN_UNITS), ctx=ctxs[0]))


def param_list(net: Any) -> list[Any]:
    """Parameters in the trainer's key order (gluon sorts a ParameterDict by name)."""
    params = net.collect_params()
    return [params[k] for k in sorted(params.keys())]


def initial_values(net: Any, seed: int, trial: int) -> list[np.ndarray]:
    rng = np.random.RandomState([seed, trial, 7])
    return [(rng.standard_normal(p.shape) * 0.5).astype(np.float32) for p in param_list(net)]


def global_batch(seed: int, trial: int, step: int, size: int,
                 features: str = "raw") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState([seed, trial, step, 11])
    if features == "preprocessed":
        X = preprocessed(seed, raw_table(rng, size, known_kinds=4))
    else:
        X = rng.standard_normal((size, IN_UNITS)).astype(np.float32)
    y = rng.randint(0, CLASSES, size).astype(np.float32)
    return X, y


# ``--features preprocessed``: rows of a raw table (6 numbers of very different scales, one text
# column; missing values in both) through the pipeline's table preprocessing (data_checks.preprocess:
# standardise, impute, one-hot with an unknown bucket), fitted on a train block of its own: 6 + 3
# categories + unknown = IN_UNITS features. A step's rows also hold a category the fit never saw.
KINDS = {"a": 0, "b": 1, "c": 2, "d": 3}
NUMBERS = [f"x{i}" for i in range(6)]


def raw_table(rng: np.random.RandomState, size: int, known_kinds: int) -> np.ndarray:
    X = np.empty((size, len(NUMBERS) + 1), np.float32)
    X[:, :-1] = rng.standard_normal((size, len(NUMBERS))) * np.logspace(-2, 4, len(NUMBERS)) + 50.0
    X[:, -1] = rng.randint(0, known_kinds, size)
    X[rng.rand(*X.shape) < 0.1] = np.nan
    return X


def preprocessed(seed: int, raw: np.ndarray) -> np.ndarray:
    from types import SimpleNamespace

    from common.config import DataConfig
    from data_checks import preprocess

    layout = SimpleNamespace(feature_columns=[*NUMBERS, "kind"])
    fitted_on = raw_table(np.random.RandomState([seed, 13]), 256, known_kinds=3)
    record = preprocess.fit(lambda: iter([fitted_on]), layout, {"kind": KINDS},
                            DataConfig(source_uri="kvstore-reference.csv", missing_values="impute"))
    X, _ = preprocess.transform(record, raw, preprocess.category_slots(record, {"kind": KINDS}))
    assert X.shape[1] == IN_UNITS and np.isfinite(X).all(), record["output_columns"]
    return X


def optimizer_params(name: str) -> dict[str, Any]:
    """The same settings for the distributed run and the reference.

    No ``rescale_grad``: ``trainer.step(global_batch)`` sets it (gluon multiplies the two).
    Adam gets ``epsilon=1e-4``: with the default 1e-8 a gradient component that sums to almost
    zero moves by about ``±lr`` whatever its size, so the float32 summation order alone
    sometimes shows up as a 1e-4..1e-3 difference (5e-4 once in 300 simulated trials). That
    is a property of Adam, not of the kvstore, and would blur the line between float noise and
    a wrong result. With 1e-4 the worst of 300 was 6e-7.
    """
    params: dict[str, Any] = {"learning_rate": 0.05}
    if name in ("sgd", "nag"):
        params["momentum"] = 0.9
    if name == "adam":
        params["epsilon"] = 1e-4
    return params


def set_params(net: Any, values: list[np.ndarray]) -> None:
    """The same values on every context of every parameter."""
    mx = import_mxnet()
    for p, v in zip(param_list(net), values):
        p.set_data(mx.nd.array(v))
    mx.nd.waitall()


def get_params(net: Any) -> list[np.ndarray]:
    return [p.list_data()[0].asnumpy() for p in param_list(net)]


def train_steps(mx: Any, net: Any, trainer: Any, batches: list[tuple[np.ndarray, np.ndarray]],
                ctxs: list[Any], rescale: int) -> None:
    """Forward/backward of each batch split over ``ctxs``, then one trainer step per batch."""
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for X, y in batches:
        xs = np.array_split(X, len(ctxs))
        ys = np.array_split(y, len(ctxs))
        with mx.autograd.record():
            losses = [loss_fn(net(mx.nd.array(xb, ctx=c)), mx.nd.array(yb, ctx=c))
                      for xb, yb, c in zip(xs, ys, ctxs)]
        mx.autograd.backward(losses)
        trainer.step(rescale)


def reference(seed: int, trial: int, steps: int, global_size: int, optimizer: str, *, net_kind: str = "mlp",
              features: str = "raw") -> list[np.ndarray]:
    """Single process, one context, no kvstore, on the whole global batch of every step."""
    mx = import_mxnet()
    net = build_net(mx, f"ref{trial}_", net_kind)
    initialize(mx, net, [mx.cpu()])
    set_params(net, initial_values(net, seed, trial))
    trainer = mx.gluon.Trainer(param_list(net), optimizer, optimizer_params(optimizer),
                               kvstore=None)
    batches = [global_batch(seed, trial, s, global_size, features) for s in range(steps)]
    train_steps(mx, net, trainer, batches, [mx.cpu()], global_size)
    mx.nd.waitall()
    return get_params(net)


def two_bit(residual: np.ndarray, grad: np.ndarray, threshold: float) -> np.ndarray:
    """MXNet's 2-bit quantisation with error feedback (``src/kvstore/gradient_compression-inl.h``),
    written out: the residual takes the gradient; an element at or beyond ``±threshold`` sends
    ``±threshold`` and keeps the rest for the next push. Updates ``residual`` in place."""
    residual += grad
    sent = np.where(residual >= threshold, threshold,
                    np.where(residual <= -threshold, -threshold, 0.0)).astype(np.float32)
    residual -= sent
    return sent


def reference_two_bit(seed: int, trial: int, steps: int, num_workers: int, batch: int, optimizer: str,
                      threshold: float, *, feedback: bool = True) -> tuple[list[np.ndarray], float]:
    """What a ``num_workers``-worker dist_sync job with 2-bit compression must compute, in one
    process without a kvstore: every step, each worker's gradient on its own slice of the global
    batch (the unscaled sum over its rows, as gluon's backward leaves it), quantised with that
    worker's residual; the sum of the quantised gradients is what every worker's (or the
    servers') optimizer applies, scaled by ``1/global batch``. ``feedback=False`` drops the
    residual after each push (the negative control). Returns the parameters and the fraction of
    gradient values that were sent (nonzero), so a test can check the threshold is exercised."""
    mx = import_mxnet()
    net = build_net(mx, f"ref2bit{trial}_")
    net.initialize(ctx=mx.cpu())
    set_params(net, initial_values(net, seed, trial))
    params = param_list(net)
    trainer = mx.gluon.Trainer(params, optimizer, optimizer_params(optimizer), kvstore=None)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    residuals = [[np.zeros(p.shape, np.float32) for p in params] for _ in range(num_workers)]
    sent_values = total_values = 0
    for s in range(steps):
        X, y = global_batch(seed, trial, s, batch * num_workers)
        summed = [np.zeros(p.shape, np.float32) for p in params]
        for r in range(num_workers):
            with mx.autograd.record():
                loss = loss_fn(net(mx.nd.array(X[r * batch:(r + 1) * batch])),
                               mx.nd.array(y[r * batch:(r + 1) * batch]))
            loss.backward()
            for i, p in enumerate(params):
                if not feedback:
                    residuals[r][i][:] = 0.0
                sent = two_bit(residuals[r][i], p.grad().asnumpy(), threshold)
                sent_values += int(np.count_nonzero(sent))
                total_values += sent.size
                summed[i] += sent
        for p, g in zip(params, summed):
            p.grad()[:] = mx.nd.array(g)
        trainer.step(batch * num_workers)
    mx.nd.waitall()
    return get_params(net), sent_values / max(total_values, 1)


def run_trials(args: argparse.Namespace) -> dict[str, Any]:
    mx = import_mxnet()
    from training.loop.kvstore_sync import make_trainer
    from training.loop.placement import SplitNet, make_split_trainer

    kv = mx.kv.create(args.kvstore)
    rank, num_workers = kv.rank, kv.num_workers
    ctxs = [mx.cpu(i) for i in range(args.contexts)]
    split = args.placement == "split"
    global_size = args.batch * num_workers
    if args.compression:
        # Once, on the store itself, before any key exists; the trials' key-shifted views share it.
        kv = with_gradient_compression(kv, args.compression)
    timings, placed = [], {}
    for trial in range(args.trials):
        started = time.monotonic()
        net = build_net(mx, f"t{trial}_", args.net)
        if split:
            net = SplitNet(net, ctxs)
            net.initialize(mx.init.Uniform(), ctx=ctxs)
            placed = {p.name.split("_", 1)[1]: str(p.list_ctx()) for p in param_list(net)}
        else:
            initialize(mx, net, ctxs)
        values = initial_values(net, args.seed, trial)
        if rank != 0 and not args.same_init:
            # Wrong on purpose: only the initial sync from rank 0 can make this worker correct.
            values = [v * -3.0 + 1.0 for v in values]
        set_params(net, values)
        trial_kv = with_key_offset(kv, trial * KEY_STRIDE)
        if args.impl == "stock":
            # Plain gluon, kvstore initialised lazily inside the first step(): the unsafe order.
            trainer = mx.gluon.Trainer(param_list(net), args.optimizer, optimizer_params(args.optimizer),
                                       kvstore=trial_kv, update_on_kvstore=args.optimizer_on == "servers")
        elif split:
            trainer = make_split_trainer(net, args.optimizer, lambda: optimizer_params(args.optimizer), trial_kv,
                                         batch_size=global_size)
        else:
            trainer = make_trainer(param_list(net), args.optimizer, optimizer_params(args.optimizer),
                                   trial_kv, args.optimizer_on, batch_size=global_size)
        batches = []
        for s in range(args.steps):
            X, y = global_batch(args.seed, trial, s, global_size, args.features)
            batches.append((X[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]))
        train_steps(mx, net, trainer, batches, ctxs[:1] if split else ctxs, global_size)
        mx.nd.waitall()
        np.savez(os.path.join(args.out, f"rank{rank}-trial{trial}.npz"), *get_params(net))
        timings.append(time.monotonic() - started)
        print(f"rank {rank} trial {trial} done in {timings[-1]:.2f}s", flush=True)
    return {"rank": rank, "num_workers": num_workers, "trial_s": timings, "placed": placed,
            "params": [p.name for p in param_list(net)]}


def run_async_checks(args: argparse.Namespace) -> dict[str, Any]:
    """dist_async has no sequential reference; check what it does promise instead.

    - counter: a parameter that the servers' optimizer turns into a sum of pushes (SGD with
      learning rate -1 adds each pushed "gradient"). Worker r pushes (r + 1, 1, 0) exactly
      5 + r times; after a barrier every worker must pull the exact total, i.e. every push of
      every worker was applied once.
    - converge: linear least squares, each worker on its own data stream; the servers' weights
      must come close to the true coefficients.
    A worker barrier closes every phase, so no push of one phase meets the next phase's optimizer.
    """
    mx = import_mxnet()
    from training.loop.kvstore_sync import make_trainer

    kv = mx.kv.create("dist_async")
    rank, W = kv.rank, kv.num_workers
    result: dict[str, Any] = {"rank": rank, "num_workers": W, "counter": [], "counter_expected":
                              [sum((r + 1) * (5 + r) for r in range(W)), sum(5 + r for r in range(W)), 0.0]}
    for trial in range(args.trials):
        trial_kv = with_key_offset(kv, trial * KEY_STRIDE)
        counter = mx.gluon.Parameter(f"counter{trial}", shape=(3,), init=mx.init.Zero())
        counter.initialize(ctx=mx.cpu())
        trainer = make_trainer([counter], "sgd", {"learning_rate": -1.0}, trial_kv, "servers", batch_size=1)
        for _ in range(5 + rank):
            counter.list_grad()[0][:] = mx.nd.array([rank + 1, 1, 0])
            trainer.step(1, ignore_stale_grad=True)
        mx.nd.waitall()
        kv._barrier()
        total = mx.nd.zeros((3,))
        trial_kv.pull(0, out=total)
        result["counter"].append(total.asnumpy().tolist())
        kv._barrier()

    true_w = np.random.RandomState([args.seed, 99]).standard_normal((1, IN_UNITS)).astype(np.float32)
    net = mx.gluon.nn.Dense(1, in_units=IN_UNITS, prefix="lsq_")
    net.initialize(mx.init.Zero(), ctx=mx.cpu())
    trainer = make_trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                           with_key_offset(kv, args.trials * KEY_STRIDE), "servers", batch_size=args.batch)
    rng = np.random.RandomState([args.seed, rank, 123])
    loss_fn = mx.gluon.loss.L2Loss()
    for _ in range(args.steps):
        X = rng.standard_normal((args.batch, IN_UNITS)).astype(np.float32)
        y = X @ true_w.T + 0.01 * rng.standard_normal((args.batch, 1)).astype(np.float32)
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(X)), mx.nd.array(y))
        loss.backward()
        trainer.step(args.batch)
    mx.nd.waitall()
    kv._barrier()
    weight = mx.nd.zeros((1, IN_UNITS))
    key = sorted(net.collect_params().keys()).index("lsq_weight")
    with_key_offset(kv, args.trials * KEY_STRIDE).pull(key, out=weight)
    result["lsq_error"] = float(np.abs(weight.asnumpy() - true_w).max())
    result["lsq_start_error"] = float(np.abs(true_w).max())
    kv._barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kvstore", default="dist_sync")
    p.add_argument("--optimizer-on", default="workers", choices=("servers", "workers"))
    p.add_argument("--impl", default="safe", choices=("safe", "stock"),
                   help="safe: the pipeline's make_trainer; stock: plain gluon.Trainer, lazy kvstore init")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", type=int, default=1)
    p.add_argument("--placement", default="replicated", choices=("replicated", "split"),
                   help="split: the model's blocks in stages over the contexts (training.loop.placement)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--same-init", action="store_true", help="every rank starts from rank 0's values")
    p.add_argument("--compression", type=float, default=0.0,
                   help="2-bit gradient compression with this threshold (0: off), through the pipeline's view")
    p.add_argument("--net", default="mlp", choices=("mlp", "custom"),
                   help=f"custom: {CUSTOM_NET} from --code-dir, built by training.loop.custom_model")
    p.add_argument("--code-dir", default="", help="the folder that holds the custom network's package")
    p.add_argument("--features", default="raw", choices=("raw", "preprocessed"),
                   help="preprocessed: a raw table's rows through the pipeline's table preprocessing")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.code_dir:
        sys.path.insert(0, args.code_dir)
    os.makedirs(args.out, exist_ok=True)
    summary = run_async_checks(args) if args.kvstore == "dist_async" else run_trials(args)
    with open(os.path.join(args.out, f"rank{summary['rank']}-summary.json"), "w") as fh:
        json.dump(summary, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
