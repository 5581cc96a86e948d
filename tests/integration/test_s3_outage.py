"""The S3 server killed for 30 s in the middle of a training job, then restarted (issue 5).

A SeaweedFS instance of this test's own (free ports, its own data folder; not the session
fixture's, which other tests share) serves a real 2-worker ``dist_sync`` job of one long epoch
(20 jittered copies of digits, each step slowed by a 0.15 s sleep that leaves the arithmetic
alone, so the epoch outlasts the outage). Rank 0's fault hook SIGKILLs the server's whole process group
right after step 50 (a checkpoint step, so that checkpoint's upload is the one cut off); 30 s
later the harness starts it again on the same ports over the same data folder
(``testkit/chaos_outage.py``, scenario R3, does the work; this test asserts every check).

Expected: training goes on through the whole outage (steps are logged in its last quarter);
the cut-off upload fails, is retried with backoff and committed once S3 is back; nothing is
committed while it is down; no checkpoint is given up; every checkpoint the job committed is in
the store and verifies, none is torn, the newest is the final step; the final parameters equal
an uninterrupted run's with the same seed (run at full speed); the job finishes; no role process is left.

Robust under load: the outage starts at a training step, not at a clock time, and is timed
from that kill; every wait is bounded (job timeout, outage thread join, server start timeouts).
"""

import pytest

pytestmark = pytest.mark.integration


OUTAGE_S = 30.0


@pytest.mark.timeout(1200)
def test_training_survives_a_30s_s3_outage(tmp_path):
    from testkit import chaos
    from testkit.chaos_jobs import ChaosStack
    from testkit.chaos_outage import r3

    stack = ChaosStack(tmp_path)
    stack.start()
    try:
        with stack.environment():
            trial = r3(stack, tmp_path, chaos.base_config(), OUTAGE_S, reference=True)
    finally:
        stack.stop()  # whole process group; raises if SeaweedFS left a process behind
    details = trial.details
    print({k: details[k] for k in ("outage_s", "kill_step", "steps_during_outage", "last_step_logged_late_in_outage",
                                   "failed_uploads", "committed", "retry_lines", "stats")},
          f"recovery {trial.recovery_s}", f"diff {trial.max_abs_diff}")
    failed = {k: v for k, v in trial.checks.items() if not v}
    assert not failed, (failed, details)
    assert details["outage_s"] >= OUTAGE_S
    # Backoff: the checkpoint writer logged at least one "retrying in Ns" and gave up on none.
    assert details["retry_lines"] and "retrying in" in details["retry_lines"][0]
    assert trial.max_abs_diff is not None and trial.max_abs_diff <= chaos.EXACT_ATOL
