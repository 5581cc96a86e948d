"""The batched NaN/inf check (training.loop.step.LossCheck): same figures as a per-step asscalar,
and a non-finite loss fails naming its own step even when read back steps later."""
import math

import pytest

from common.mx import import_mxnet
from training.loop.step import LossCheck, NaNLossError

pytestmark = pytest.mark.unit


def test_figures_match_a_per_step_read():
    mx = import_mxnet()
    sums = [mx.nd.array([v]) for v in (12.375, 3.1, 7.0000005, 0.2)]
    check = LossCheck(every=3)
    expected_sum, rows = 0.0, 0
    for step, s in enumerate(sums, 1):
        check.add(step, s, 64)
        loss = float(s.asscalar()) / 64
        expected_sum += loss * 64
        rows += 64
    assert len(check.pending) == 1  # read back after step 3; step 4 still pending
    check.flush()
    assert check.loss_sum == expected_sum and check.rows == rows
    assert check.last == float(sums[-1].asscalar()) / 64


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_names_its_step(bad):
    mx = import_mxnet()
    check = LossCheck(every=8)
    for step, v in enumerate([1.0, 2.0, bad, 3.0], 11):
        check.add(step, mx.nd.array([v]), 4)
    with pytest.raises(NaNLossError) as info:
        check.flush()
    assert info.value.step == 13 and ("nan" in str(info.value) or "inf" in str(info.value))
    assert math.isfinite(check.loss_sum)


def test_on_loss_sees_every_step_in_order_once_read():
    """The per-step metrics are recorded from here: each step once, in order, only when read."""
    mx = import_mxnet()
    seen: list[tuple[int, float]] = []
    check = LossCheck(every=3, on_loss=lambda step, loss: seen.append((step, loss)))
    for step in range(1, 6):
        check.add(step, mx.nd.array([2.0 * step]), 2)
    assert seen == [(1, 1.0), (2, 2.0), (3, 3.0)]  # steps 4 and 5 are still pending
    check.flush()
    assert seen == [(s, float(s)) for s in range(1, 6)]
