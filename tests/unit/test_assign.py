"""The streaming split/shard assignment: its documented guarantees (no I/O)."""
from __future__ import annotations

import numpy as np
import pytest

from data_checks.assign import TEST, TRAIN, VAL, Assigner, SplitBlock, expected_bounds

pytestmark = pytest.mark.unit


def assign_all(classes: np.ndarray, chunk: int, shards: int = 3, seed: int = 7) -> tuple[np.ndarray, ...]:
    assigner = Assigner(SplitBlock.from_fractions(0.1, 0.2), shards, seed)
    for c in np.unique(classes):
        assigner.add_class(int(c), f"class-{c}")
    parts = []
    for start in range(0, len(classes), chunk):
        rows = np.arange(start, min(start + chunk, len(classes)))
        emitted, split, shard, _ = assigner.assign(classes[rows], rows)
        parts.append((emitted, split, shard))
    parts.append(assigner.finish())
    return tuple(np.concatenate(p) for p in zip(*parts))


@pytest.fixture(scope="module")
def classes() -> np.ndarray:
    rng = np.random.default_rng(3)
    labels = rng.choice(6, size=5000, p=[0.4, 0.3, 0.2, 0.07, 0.0296, 0.0004])
    labels[[10, 4000]] = 6  # a class of 2 rows: all train
    labels[[20, 21, 4999]] = 7  # a class of exactly 3 rows: one per split
    return labels


def test_same_result_for_any_chunk_size(classes):
    reference = assign_all(classes, 100_000)
    for chunk in (2, 7, 999):
        for a, b in zip(reference, assign_all(classes, chunk)):
            np.testing.assert_array_equal(a, b)
    other_seed = assign_all(classes, 100_000, seed=8)
    assert not np.array_equal(reference[1], other_seed[1])


def test_every_row_once_and_the_documented_bounds(classes):
    emitted, split, shard = assign_all(classes, 512)
    assert sorted(emitted.tolist()) == list(range(len(classes)))
    block = SplitBlock.from_fractions(0.1, 0.2)
    assert (block.size, block.test, block.val) == (10, 2, 1)
    by_row = np.empty(len(classes), np.int8)
    by_row[emitted] = split
    for c in np.unique(classes):
        got = np.bincount(by_row[classes == c], minlength=3)
        n = int((classes == c).sum())
        if n < 3:
            assert got.tolist() == [n, 0, 0]
            continue
        bounds = expected_bounds(n, block)
        assert bounds["test"][0] <= got[TEST] <= bounds["test"][1], (c, n, got)
        assert bounds["val"][0] <= got[VAL] <= bounds["val"][1], (c, n, got)
        assert got[TRAIN] >= 1
    assert np.bincount(by_row[classes == 7], minlength=3).tolist() == [1, 1, 1]


def test_train_shards_differ_by_at_most_one(classes):
    for shards in (1, 3, 8):
        _, split, shard = assign_all(classes, 333, shards=shards)
        sizes = np.bincount(shard[split == TRAIN], minlength=shards)
        assert len(sizes) == shards and sizes.max() - sizes.min() <= 1
        assert (shard[split != TRAIN] == -1).all()


@pytest.mark.parametrize("val, test, size", [(0.1, 0.2, 10), (0.15, 0.15, 20), (0.05, 0.25, 20), (0.123, 0.2, 1000)])
def test_block_sizes(val, test, size):
    block = SplitBlock.from_fractions(val, test)
    assert block.size == size and block.test >= 1 and block.val >= 1 and block.size - block.test - block.val >= 1
