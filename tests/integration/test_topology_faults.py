"""The cheapest of issue 27's faults on the namespace topology (``testkit.topology_faults``): the
triggerer host's processes killed while the train task is deferred (a triggerer started again
takes the trigger up), and the S3 host's link down for 20 s while training. Each run finishes
and ends with the parameters of an uninterrupted run of the same config and seed (the final
checkpoint's arrays and the registered model's parameter file, by sha256).

Its own tier (``-m topology``, ``make test-topology``): the topology takes minutes and the
machine. ``benchmarks/topology_faults.py`` runs every fault, with recovery times."""
import shutil
import tempfile
from pathlib import Path

import pytest
from infra.topology import TopologySettings, down, up
from testkit.topology_faults import fault_run
from testkit.topology_runs import leftovers, missing_tools

pytestmark = [pytest.mark.topology, pytest.mark.skipif(bool(missing_tools()), reason=missing_tools() or "ok")]


@pytest.fixture(scope="module")
def topology():
    settings = TopologySettings()
    # Not pytest's tmp_path: its mode-0700 parents keep out PostgreSQL's own user.
    root = Path(tempfile.mkdtemp(prefix="mxpipe-topology-faults-"))
    root.chmod(0o755)
    try:
        up(root, settings)
        yield root
    finally:
        stopped = down(root)
        shutil.rmtree(root, ignore_errors=True)
        assert stopped and leftovers(settings) == {"namespaces": [], "uplink": False, "processes": []}


@pytest.fixture(scope="module")
def baseline(topology, digits_csv):
    run = fault_run(topology, digits_csv, "baseline")
    assert run["state"] == "success", run
    return run


@pytest.mark.parametrize("fault", ["triggerer", "s3_link"])
def test_a_fault_during_training_ends_in_a_finished_run_with_the_baselines_parameters(topology, baseline,
                                                                                      digits_csv, fault):
    run = fault_run(topology, digits_csv, fault, fault)
    assert run["error"] is None, run  # the fault landed where it should (mid-training)
    assert run["state"] == "success" and set(run["states"].values()) <= {"success", "skipped"}, run
    assert run["params"] == baseline["params"], (run["params"], baseline["params"])
    if fault == "triggerer":
        measured = run["measured"]
        assert measured["new_triggerer_job"] != measured["old_triggerer_job"], measured
