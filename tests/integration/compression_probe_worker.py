"""One worker of a 2-bit compression probe job: push known gradients through the engine's
compressing kvstore view (``training.loop.kvstore_sync.with_gradient_compression``) and save what
every pull returned, so the test can compare it with MXNet's quantisation written out in numpy.

Every push's gradient is a pure function of ``(seed, rank, step)``; run by
``test_engine_modes.py`` as the worker of a real ``dist_sync`` ps-lite job.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common.mx import import_mxnet  # noqa: E402
from training.loop.kvstore_sync import with_gradient_compression  # noqa: E402

# Two keys: one a multiple of 16 values (whole 2-bit words), one not (a partly filled last word).
SHAPES = ((8, 16), (37,))


def gradient(seed: int, rank: int, step: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.RandomState([seed, rank, step, int(np.prod(shape))])
    return (rng.standard_normal(shape) * 0.6).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mx = import_mxnet()
    kv = with_gradient_compression(mx.kv.create("dist_sync"), args.threshold)
    for key, shape in enumerate(SHAPES):
        kv.init(key, mx.nd.zeros(shape))
    pulled: dict[str, np.ndarray] = {}
    for step in range(args.steps):
        for key, shape in enumerate(SHAPES):
            grad = mx.nd.array(gradient(args.seed, kv.rank, step, shape))
            out = mx.nd.zeros(shape)
            kv.pushpull(key, grad, out=out)
            pulled[f"k{key}-s{step}"] = out.asnumpy()
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank{kv.rank}.npz"), **pulled)
    print(f"rank {kv.rank}: {args.steps} compressed push/pull rounds done", flush=True)


if __name__ == "__main__":
    main()
