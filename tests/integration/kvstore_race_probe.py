"""Evidence for docs/kvstore-correctness.md: what the lazily initialised stock gluon trainer
(``update_on_kvstore=False``, ``dist_sync``) does with the first step's parameters.

Run as the worker script of a ps-lite job (``ps_cluster.run_script_job([python, THIS, ...],
num_workers=2, record_dir=...)``); not part of the test run. Per trial it
takes one SGD step (no momentum) from parameters every rank agrees on, then classifies each
key on each rank:

- ``ok``:        w1 == w0 - lr * g / B            (the algorithm)
- ``grad-init``: w1 == g  - lr * g / B            (the initial pull returned the summed gradient)
- ``other``

where ``g`` is the all-reduced gradient sum the trainer left in the grad buffer. Prints one JSON
line per rank with the counts, and a line per ``grad-init`` key.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvstore_reference_worker as ref  # noqa: E402

from common.mx import import_mxnet  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eager", action="store_true", help="initialise the kvstore before the first forward")
    args = p.parse_args()
    mx = import_mxnet()
    kv = mx.kv.create("dist_sync")
    rank, W = kv.rank, kv.num_workers
    G, lr = args.batch * W, 0.1
    counts = {"ok": 0, "grad-init": 0, "other": 0}
    for trial in range(args.trials):
        net = ref.build_net(mx, f"p{trial}_")
        net.initialize(ctx=mx.cpu())
        w0 = ref.initial_values(net, 5, trial)
        ref.set_params(net, w0)
        params = ref.param_list(net)
        trainer = mx.gluon.Trainer(params, "sgd", {"learning_rate": lr},
                                   kvstore=ref.with_key_offset(kv, trial * ref.KEY_STRIDE),
                                   update_on_kvstore=False)
        if args.eager:
            trainer._optimizer.rescale_grad = trainer._scale / G
            trainer._init_kvstore()
            trainer._init_params()
        X, y = ref.global_batch(5, trial, 0, G)
        ref.train_steps(mx, net, trainer, [(X[rank * args.batch:(rank + 1) * args.batch],
                                            y[rank * args.batch:(rank + 1) * args.batch])], [mx.cpu()], G)
        mx.nd.waitall()
        for key, (param, start) in enumerate(zip(params, w0)):
            w1 = param.data().asnumpy()
            g = param.grad().asnumpy()
            tol = 1e-5 * (1 + np.abs(w1).max())
            if np.abs(w1 - (start - lr * g / G)).max() <= tol:
                counts["ok"] += 1
            elif np.abs(w1 - (g - lr * g / G)).max() <= tol:
                counts["grad-init"] += 1
                print(json.dumps({"rank": rank, "trial": trial, "key": key, "class": "grad-init"}), flush=True)
            else:
                counts["other"] += 1
    print(json.dumps({"rank": rank, "eager": args.eager, "trials": args.trials, **counts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
