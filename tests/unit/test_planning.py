"""Hardware planning: every expectation below is worked out by hand in the test."""
import json
import math
import os
import subprocess
import sys

import pytest

from infra.catalogue import CATALOGUE, by_name
from infra.planning import ModelShape, memory_per_device, plan, servers_for, size_on, state_per_param
from training.loop.model import count_model
from testkit import REPO

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("optimizer,kwargs,values", [
    ("sgd", {}, 0), ("sgd", {"momentum": 0.9}, 1), ("nag", {"momentum": 0.9}, 1), ("adam", {}, 2),
    ("lamb", {}, 2), ("adagrad", {}, 1), ("rmsprop", {}, 1), ("rmsprop", {"centered": True}, 2),
    ("adadelta", {}, 2),
])
def test_optimizer_state_per_parameter(optimizer, kwargs, values):
    assert state_per_param(optimizer, **kwargs) == values


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="lbfgs"):
        state_per_param("lbfgs")


def test_memory_per_device_adds_params_grads_state_and_activations():
    shape = ModelShape(params=1_000_000, aux=500, activations_per_sample=1000)
    m = memory_per_device(shape, state_per_param("adam"), per_device_batch=10)
    # 1e6 * 4 + 500 * 4 weights, 1e6 * 4 grads, 1e6 * 2 * 4 Adam state, 1000 * 4 * 10 activations.
    assert (m.params, m.grads, m.optimizer_state, m.activations) == (4_002_000, 4e6, 8e6, 40_000)
    assert m.total == 16_042_000
    half = memory_per_device(shape, 2, 10, precision="fp16")
    # AMP: fp32 weights + a 2-byte copy; fp32 grads and state; 2-byte activations.
    assert (half.params, half.grads, half.optimizer_state, half.activations) == (6_002_000, 4e6, 8e6, 20_000)
    on_servers = memory_per_device(shape, 2, 10, optimizer_on="servers")
    assert on_servers.optimizer_state == 0 and on_servers.total == 8_042_000


def test_servers_are_sized_by_the_bytes_a_step_moves():
    # 4 workers x (push + pull) x 1e6 params x 4 B = 3.2e7 B; 10 Gbps = 1.25e9 B/s moves 1.25e7 B
    # in the 10 ms budget: ceil(2.56) = 3 servers.
    assert servers_for(1_000_000, 4, 10) == 3
    # 8 x 2 x 1e8 x 4 = 6.4e9 B, far above 100 Gbps x 10 ms: capped at one server per worker.
    assert servers_for(100_000_000, 8, 100) == 8
    assert servers_for(1000, 8, 100) == 1
    assert servers_for(100_000_000, 1, 100) == 0  # one worker sums gradients locally


def test_a_10b_parameter_model_fits_no_device():
    shape = ModelShape(params=10_000_000_000)
    # Adam, fp32: 10e9 x (4 + 4 + 8) B = 160e9 B = 149 GiB per replica > 0.9 x 24 GiB (and x 80 GiB).
    g5 = size_on(by_name("g5.xlarge"), shape, 2, 32, "fp32", "workers")
    assert not g5.fits and g5.memory.total == pytest.approx(160e9)
    result = plan(shape, optimizer="adam", global_batch=32)
    assert result.best is None and not any(o.fits for o in result.options)
    assert any("does not fit on any device" in w and "80 GiB" in w for w in result.warnings)


def test_the_global_batch_is_spread_over_as_many_devices_as_memory_needs():
    # 1e9 params, plain SGD, fp32: 8e9 B fixed. A10G: 0.9 x 24 GiB = 23,193,759,334 B usable, so
    # (23,193,759,334 - 8e9) // 4e6 B per sample = 3798 samples per device; 10,000 samples need
    # ceil(10000 / 3798) = 3 devices.
    shape = ModelShape(params=1_000_000_000, activations_per_sample=1_000_000)
    one_gpu = size_on(by_name("g5.xlarge"), shape, 0, 10_000, "fp32", "workers")
    assert (one_gpu.max_batch_per_device, one_gpu.workers, one_gpu.devices_per_worker) == (3798, 3, 1)
    assert one_gpu.batch_per_device == math.ceil(10_000 / 3) and one_gpu.servers == 3
    assert one_gpu.price_per_hour == pytest.approx(3 * 1.006)
    four_gpus = size_on(by_name("g5.12xlarge"), shape, 0, 10_000, "fp32", "workers")
    assert (four_gpus.workers, four_gpus.devices_per_worker, four_gpus.servers) == (1, 3, 0)
    # V100 16 GiB: (15,461,882,265 - 8e9) // 4e6 = 1865 per device -> 6 devices on 8-GPU p3.16xlarge.
    p3 = size_on(by_name("p3.16xlarge"), shape, 0, 10_000, "fp32", "workers")
    assert (p3.max_batch_per_device, p3.workers, p3.devices_per_worker) == (1865, 1, 6)


def test_the_recommendation_is_the_cheapest_per_peak_tflop_that_fits():
    shape = ModelShape(params=1_000_000_000, activations_per_sample=1_000_000)
    result = plan(shape, optimizer="sgd", global_batch=10_000)
    fitting = [o for o in result.options if o.fits]
    assert result.best is not None and result.best.score == min(o.score for o in fitting)
    assert {o.instance.name for o in result.options} == {it.name for it in CATALOGUE}


def test_lenet_is_counted_from_the_real_network():
    # conv 3x3 1->20: 180 + 20; conv 3x3 20->50: 9000 + 50; dense 50*14*14 -> 128: 9800*128 + 128;
    # dense 128 -> 10: 1280 + 10.
    shape = ModelShape(**count_model("lenet", (1, 28, 28), 10, hidden=(128,)))
    assert shape.params == 200 + 9050 + 1_254_528 + 1290
    # Operator outputs per sample: reshape 784, conv + relu 2 x 20*28*28, pool 20*14*14,
    # conv + relu 2 x 50*14*14, flatten 9800, dense + relu 2 x 128, dense 10.
    assert shape.activations_per_sample == 784 + 2 * 15680 + 3920 + 2 * 9800 + 9800 + 2 * 128 + 10
    assert shape.aux == 0


def test_resnet50_has_about_25_6_million_parameters():
    shape = ModelShape(**count_model("resnet50", (3, 224, 224), 1000))
    # The paper's 25,557,032 plus gluon v1's biases on the bottlenecks' 1x1 convolutions:
    # 3*64+4*128+6*256+3*512 + 3*256+4*512+6*1024+3*2048 = 18,880 (tests/unit/test_models.py).
    assert shape.params == 25_557_032 + 18_880
    # BatchNorm running mean + var: stem 64; per stage, blocks x (c/4 + c/4 + c) + c (downsample).
    channels = 64 + 3 * 384 + 256 + 4 * 768 + 512 + 6 * 1536 + 1024 + 3 * 3072 + 2048
    assert shape.aux == 2 * channels
    assert shape.activations_per_sample > 10 * 224 * 224  # many feature maps, each > 1 image


def test_cli_prints_a_plan_and_fails_when_nothing_fits():
    ok = subprocess.run([sys.executable, "-m", "infra.planning", "--params", "1e6", "--batch-size", "64",
                         "--optimizer", "sgd", "--momentum", "0.9"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "recommended:" in ok.stdout and "activations not estimated" in ok.stdout
    big = subprocess.run([sys.executable, "-m", "infra.planning", "--params", "10e9"], capture_output=True,
                         text=True, timeout=120)
    assert big.returncode == 1 and "does not fit on any device" in big.stdout


def test_a_model_by_name_is_planned_by_scripts_plan_not_by_infra():
    """infra does not import the trainer: ``--model`` needs scripts/plan.py, which counts with
    training.loop.model and hands the counts to the same CLI."""
    flags = ["--model", "lenet", "--input-shape", "1,28,28", "--classes", "10", "--batch-size", "64", "--json"]
    refused = subprocess.run([sys.executable, "-m", "infra.planning", *flags], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert refused.returncode == 2 and "scripts/plan.py" in refused.stderr
    ok = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plan.py"), *flags], capture_output=True,
                        text=True, timeout=300, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    counts = count_model("lenet", (1, 28, 28), 10)
    assert json.loads(ok.stdout)["params"] == counts["params"]


def test_planning_imports_neither_airflow_nor_mxnet_nor_the_trainer():
    code = ("import sys, infra.planning; bad = [m for m in ('airflow', 'mxnet', 'training') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
