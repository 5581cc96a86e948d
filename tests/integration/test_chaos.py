"""The chaos harness (testkit/chaos.py, which benchmarks/chaos.py runs) in quick mode: real
2-worker ``dist_sync`` jobs on the local backend against a SeaweedFS S3 server of the harness's own.

R1: two randomized trials (seed 17 kills the scheduler at step 30 and the server at step 60, the
last step, where the epoch-end checkpoint never happens; ``MXPIPE_CHAOS_SEED`` picks other
trials; worker kills are covered here when the seed draws them and always by
test_checkpoint_resume.py). R2: a torn checkpoint, a corrupt one, and a rerun of a finished run.
Every check of every trial must hold: finished, resumed from the newest checkpoint that
verifies, parameters within 1e-6 of the uninterrupted reference, no role process left anywhere.

Bounded: every job attempt has a 300 s job timeout (the supervisor then stops every role), and
the whole test has a pytest timeout.
"""
import os

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1800)
def test_quick_chaos_run_passes_every_check(tmp_path):
    from testkit import chaos

    seed = int(os.environ.get("MXPIPE_CHAOS_SEED", "17"))
    report = chaos.run(tmp_path, ["R1", "R2"], trials=2, seed=seed, outage_s=0)
    print(chaos.table(report["rows"]))
    trials = report["trials"]
    assert [t["scenario"] for t in trials] == ["R1", "R1", "R2", "R2", "R2"]
    failed = {t["name"]: {k: v for k, v in t["checks"].items() if not v} | {"details": t["details"]}
              for t in trials if not t["passed"]}
    assert not failed, failed
    for t in trials:
        assert t["checks"], t  # a trial with no checks would pass vacuously
        if t["name"] != "rerun of a finished run (resume at the final step)":
            assert t["recovery_s"] is not None and 0 < t["recovery_s"] < 120, t
        assert t["max_abs_diff"] is not None and t["max_abs_diff"] <= chaos.EXACT_ATOL
    victims = {t["details"]["victim"] for t in trials if t["scenario"] == "R1"}
    if seed == 17:
        assert victims == {"scheduler", "server-0"}

