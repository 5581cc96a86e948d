"""The CPU of one checkpoint save of the digits MLP's size, alone (``infra.perf_model.SAVE_CPU_S``).

    .venv/bin/python benchmarks/save_alone.py

params.npz 10.6 kB, trainer.states 20 kB, state.json about 50 kB, keep=3, local storage, in a
writer thread as the uploader runs it: serialise (np.savez, pickle), ``CheckpointStore.save``
(hash pool, 3 files and the manifest, the prune). 60 saves; prints the medians."""
import io, json, os, pickle, statistics, sys, tempfile, threading, time
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.checkpoint.store import CheckpointStore  # noqa: E402

rng = np.random.default_rng(0)
params = {"0.weight": rng.standard_normal((32, 64), dtype=np.float32), "0.bias": np.zeros(32, np.float32),
          "1.weight": rng.standard_normal((10, 32), dtype=np.float32), "1.bias": np.zeros(10, np.float32)}
states = {i: (a.copy(), a.copy()) for i, a in enumerate(params.values())}
state = {"history": [{"epoch": e, "x": [0.123456789] * 250} for e in range(16)]}
cpu, wall = [], []
with tempfile.TemporaryDirectory() as tmp:
    store = CheckpointStore(tmp, keep=3)
    for step in range(10, 610, 10):
        def write() -> None:
            c = time.thread_time()
            buf = io.BytesIO()
            np.savez(buf, **params)
            files = {"params.npz": buf.getvalue(), "trainer.states": pickle.dumps((states, "adam"))}
            store.save(step, files, state)
            cpu.append(time.thread_time() - c)
        t = time.perf_counter()
        th = threading.Thread(target=write)
        th.start()
        th.join()
        wall.append(time.perf_counter() - t)
print(f"state.json {len(json.dumps(state)) / 1e3:.0f} kB; per save: CPU median {statistics.median(cpu) * 1e3:.2f} ms "
      f"(writer thread; the hash pool's thread not in it), wall median {statistics.median(wall) * 1e3:.2f} ms, "
      f"mean {statistics.mean(wall) * 1e3:.2f} ms")
