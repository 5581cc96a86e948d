"""Constrained links on the ``hosts`` backend over network namespaces: a cut and a lossy link.

Chaos R4's long cut (testkit/chaos_net.py): worker-1's host link on the ``hosts`` backend
over network namespaces goes down for longer than the job's stall timeout (20 s). The job must
be torn down by the stall detector with one clear error, leave no role process on this machine
or in any namespace, and a retry must resume from a checkpoint and finish.

The short cut (5 s, which the job rides out) is in ``benchmarks/chaos.py --scenarios R4`` only,
to keep this test near two minutes. Needs root and ``ip netns``; skipped with the reason if not.
"""
import os

import pytest

from testkit import chaos_net
from testkit import constrained_links
from testkit.digits import digits_csv
from testkit.netns_hosts import link_stats, namespace_hosts

pytestmark = pytest.mark.integration

_WHY_NOT = chaos_net.why_not()


@pytest.mark.skipif(bool(_WHY_NOT), reason=f"network namespaces unavailable: {_WHY_NOT}")
@pytest.mark.timeout(600)
def test_link_cut_past_the_stall_timeout_tears_the_job_down_and_the_retry_resumes(tmp_path):
    (trial,) = chaos_net.r4(tmp_path, [chaos_net.STALL_S + 10.0])
    failed = {k: v for k, v in trial.checks.items() if not v}
    assert not failed, (failed, trial.details)
    assert "stalled: no output for 20s" in trial.details["first_error"]
    assert "last lines of worker-" in trial.details["first_error"]  # the error carries the role's tail
    assert trial.details["orphans"] == []
    assert trial.details["resumed_step"] and trial.details["final_step"]


LOSS_PCT = 10.0


@pytest.mark.skipif(bool(_WHY_NOT or constrained_links.shaping_available()),
                    reason=f"links cannot be shaped here: {_WHY_NOT or constrained_links.shaping_available()}")
@pytest.mark.timeout(600)
def test_a_lossy_link_slows_the_job_without_failing_it(tmp_path):
    """Worker-1's host loses 10 % of the packets it sends and receives: TCP retransmits, the
    steps take longer than on the clean link, and the job finishes as accurate as before."""
    from data_checks.shard import shard_dataset
    from testkit.chaos import base_config

    data = tmp_path / "data"
    data.mkdir()
    (data / "digits.csv").write_bytes(digits_csv(1))
    cfg = base_config().replace(data={"source_uri": str(data / "digits.csv")}, optim={"epochs": 2},
                                cluster={"stall_timeout_s": 60.0})
    shard_dataset(cfg, str(data / "shards"))
    with namespace_hosts(3, prefix=f"mxls{os.getpid() % 10000}") as hosts:
        clean = constrained_links.run_job(str(tmp_path), hosts, cfg, str(data / "shards"), "clean")
        constrained_links.shape_link(hosts[chaos_net.VICTIM_HOST], loss_pct=LOSS_PCT)
        try:
            lossy = constrained_links.run_job(str(tmp_path), hosts, cfg, str(data / "shards"), "lossy")
            lost = link_stats(hosts[chaos_net.VICTIM_HOST])["lost"]
        finally:
            constrained_links.clear_link(hosts[chaos_net.VICTIM_HOST])
    print({"clean": clean, "lossy": lossy, "packets_lost": lost})
    assert lost > 0
    assert lossy["steps"] == clean["steps"]
    assert lossy["step_time_s"] > clean["step_time_s"], (lossy, clean)
    assert abs(lossy["val_accuracy"] - clean["val_accuracy"]) < 1e-9  # dist_sync: the same arithmetic
