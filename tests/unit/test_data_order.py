import numpy as np
import pytest

from training.feed.data import EpochOrder, shards_for_rank, steps_per_epoch

pytestmark = pytest.mark.unit


def _manifest(counts):
    return {"shards": [{"name": f"train-{i:05d}", "split": "train", "count": c} for i, c in enumerate(counts)]
            + [{"name": "val", "split": "val", "count": 5}]}


def test_every_worker_runs_the_same_number_of_steps_on_uneven_shards():
    m = _manifest([10, 7, 3, 3])
    # worker 0 gets shards 0,2 (13 rows), worker 1 gets 1,3 (10 rows) → 13 rows / 4 = 4 steps each
    assert [s["name"] for s in shards_for_rank(m, 0, 2)] == ["train-00000", "train-00002"]
    assert steps_per_epoch(m, 2, 4) == 4


def test_worker_without_data_is_refused():
    with pytest.raises(ValueError, match="no data"):
        steps_per_epoch(_manifest([10]), 2, 4)


def test_epoch_order_is_deterministic_and_covers_every_row():
    order = EpochOrder(num_rows=10, steps=4, batch_size=3, seed=7, rank=1)
    a = [idx.tolist() for _, idx in order.batches(epoch=2)]
    b = [idx.tolist() for _, idx in order.batches(epoch=2)]
    assert a == b
    flat = np.concatenate(a)
    assert len(flat) == 12 and set(flat.tolist()) == set(range(10))
    assert a != [idx.tolist() for _, idx in order.batches(epoch=3)]


def test_resume_position_continues_the_same_sequence():
    order = EpochOrder(num_rows=50, steps=10, batch_size=5, seed=1, rank=0)
    full = [idx.tolist() for _, idx in order.batches(epoch=4)]
    tail = [idx.tolist() for _, idx in order.batches(epoch=4, start_step=6)]
    assert tail == full[6:]
