"""Denormal flushing (common.fpmode): what a role process computes with it on and off, and how
the launcher asks every role for it."""
import json
import os
import subprocess
import sys

import pytest
from common import fpmode
from common.roles import SERVER, WORKER, role_argv, role_env
from testkit import REPO

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not fpmode.supported(), reason="FTZ/DAZ are x86-64 MXCSR bits")]


# What a role does at start (apply_from_env, then mxnet), then operators that run on MXNet's
# engine and OpenMP threads: an elementwise product whose exact result is denormal, on an array
# large enough to be split over OpenMP threads, and a dot product of denormal inputs.
PROBE = """
import json, warnings
# NumPy's limits computed with the bits set warn "the smallest subnormal ... is zero": fail on it.
warnings.filterwarnings("error", message=".*smallest subnormal", category=UserWarning)
from common.fpmode import apply_from_env, flushing
on = apply_from_env()
from common.mx import import_mxnet
mx = import_mxnet()
n = 1 << 20
tiny = mx.nd.full((n,), 1e-39)  # below float32's smallest normal, 1.18e-38
product = (mx.nd.full((n,), 1e-20) * 1e-20).asnumpy()  # 1e-40: denormal when computed exactly
dot = mx.nd.dot(tiny.reshape((1, -1)), mx.nd.ones((n, 1))).asscalar()
print(json.dumps({"on": on, "flushing": flushing(), "product_max": float(product.max()),
                  "dot": float(dot)}))
"""


def _probe(flag: str) -> dict:
    env = {**os.environ, fpmode.ENV: flag, "OMP_NUM_THREADS": "2", "MXNET_CPU_WORKER_NTHREADS": "2",
           "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_flushing_role_computes_denormal_results_as_zero_on_the_engine_threads():
    on = _probe("1")
    assert on["on"] and on["flushing"]
    assert on["product_max"] == 0.0 and on["dot"] == 0.0


def test_without_the_flag_denormals_are_kept():
    off = _probe("0")
    assert not off["on"] and not off["flushing"]
    assert 0 < off["product_max"] < 1.2e-38
    assert off["dot"] > 1e-33  # 2^20 x 1e-39


def test_every_role_gets_the_configured_mode():
    from common.config import recipe
    from training.launch.launcher import launch_for

    base = {"PATH": "/bin", fpmode.ENV: "1"}  # an inherited value never overrides the config
    for setting, flag in ((True, "1"), (False, "0")):
        cfg = recipe("debug").replace(cluster={"flush_denormals": setting})
        launch = launch_for(cfg, "j")
        for kind in (SERVER, WORKER):
            env = role_env(launch, kind, node_host="127.0.0.1", root_uri="127.0.0.1", root_port=9091, base=base,
                           repo_root="/opt/mxpipe")
            assert env[fpmode.ENV] == flag
    # A server or scheduler is `import mxnet`: the mode must be applied before that import.
    code = role_argv(SERVER, "j")[-1]
    assert code.index("apply_from_env()") < code.index("import_mxnet()")


def test_flush_denormals_must_be_a_boolean():
    from common.config import ConfigError, recipe

    with pytest.raises(ConfigError, match="cluster.flush_denormals must be true or false"):
        recipe("debug").replace(cluster={"flush_denormals": "yes"})
