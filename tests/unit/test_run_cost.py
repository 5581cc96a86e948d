"""A run's cost figures: the role usage meter on real processes, the totals across attempts, the
recomputation share, EC2 instance-hours and price, and the epoch/step lines live tracking reads."""
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from common.events import EpochDone, FirstStepAfterResume, Progress, WorkerStarted, event_line
from common.procs.usage import UsageMeter
from infra.billing import instance_cost
from training.launch.launcher import outcome_of
from training.tracking.cost import RunCost, summary
from training.tracking.live import LiveRun

pytestmark = pytest.mark.unit

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_meter_counts_a_process_tree_within_wall_time_times_cores():
    # A parent that burns CPU itself and through a child: both are in the role's tree.
    code = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.6)!r}])\n"
            + BURN.format(s=0.6) + "p.wait()\n")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code])
    meter = UsageMeter()
    while proc.poll() is None:
        meter.sample({"worker-0": proc.pid})
        time.sleep(0.05)
    wall = time.monotonic() - started
    usage = meter.trees["worker-0"]
    # Both burned 0.6 s; what each used after its last sample is lost (at most one interval).
    assert 0.6 < usage.core_seconds <= wall * os.cpu_count()
    assert usage.rss_bytes > 0 and usage.seconds_alive > 0


def test_meter_ignores_roles_that_are_gone():
    assert UsageMeter().sample({"worker-0": 2**22 + 12345}) == {}


def test_totals_add_up_across_attempts_and_count_recomputed_steps():
    first = RunCost(core_seconds={"worker-0": 10.0, "server-0": 2.0})
    first.at_step(120)  # the attempt died at step 120 (the newest checkpoint was step 100)
    m1 = first.metrics()
    assert m1["cost.core_seconds"] == 12.0 and m1["cost.recompute_share"] == 0.0
    assert m1["cost.steps_trained"] == 120 and m1["cost.highest_step"] == 120

    second = RunCost.from_run({**m1, "train_loss": 0.3})
    second.resumed_from(100)
    second.at_step(200)
    second.core_seconds = {"worker-0": 15.0, "server-0": 3.0}
    m2 = second.metrics()
    assert m2["cost.core_seconds.worker-0"] == 25.0 and m2["cost.core_seconds"] == 30.0
    assert m2["cost.steps_trained"] == 220 and m2["cost.steps_recomputed"] == 20
    assert m2["cost.recompute_share"] == pytest.approx(20 / 220)
    assert m2["cost.recompute_core_seconds"] == pytest.approx(30.0 * 20 / 220)
    assert "GPU-seconds" not in summary(m2) and "recomputation 0.091 of 220 steps" in summary(m2)


def test_ec2_instance_hours_are_priced_on_demand_from_the_catalogue_and_spot_from_its_history():
    now = datetime(2026, 1, 1, 12, tzinfo=timezone.utc)
    on_demand = {"InstanceId": "i-1", "InstanceType": "g5.xlarge", "LaunchTime": now - timedelta(hours=2)}
    spot = {"InstanceId": "i-2", "InstanceType": "g5.xlarge", "LaunchTime": now - timedelta(hours=1),
            "InstanceLifecycle": "spot", "Placement": {"AvailabilityZone": "us-east-1a"}}
    asked = []

    def spot_price(kind, zone, since):
        asked.append((kind, zone, since))
        return 0.4

    cost = instance_cost([on_demand, spot], now, spot_price)
    assert cost == {"cost.instance_hours": 3.0, "cost.usd": pytest.approx(2 * 1.006 + 0.4)}
    assert asked == [("g5.xlarge", "us-east-1a", now - timedelta(hours=1))]
    # An unknown price leaves the dollars out rather than understating them.
    cost = instance_cost([{**on_demand, "InstanceType": "c9.huge"}], now, spot_price)
    assert cost == {"cost.instance_hours": 2.0}


def test_live_run_reads_rank0_epoch_records_and_the_steps_of_every_worker():
    # ps-lite gave rank 0 to worker-1 here: worker-0's records (no validation) are not the run's.
    live = LiveRun(tracking_uri="http://127.0.0.1:9", experiment="x", run_name="r", find_tags={"a": "b"})
    live.on_line("worker-1", "INFO worker 0/2 started (kvstore=dist_sync) optimizer on the workers")
    live.on_line("worker-1", "INFO events: " + event_line(WorkerStarted(rank=0, num_workers=2)))
    live.on_line("worker-0", "INFO events: " + event_line(WorkerStarted(rank=1, num_workers=2)))
    live.on_line("worker-0", "INFO events: " + event_line(EpochDone(epoch=0, global_step=10,
                                                                    record={"epoch": 0, "train_loss": 2.0})))
    live.on_line("worker-1", "INFO events: " + event_line(FirstStepAfterResume(global_step=41, resumed_from=40)))
    live.on_line("worker-1", "INFO events: " + event_line(EpochDone(epoch=1, global_step=50, record={
        "epoch": 1, "global_step": 50, "train_loss": 1.5, "val_accuracy": 0.5})))
    live.on_line("worker-0", "INFO events: " + event_line(Progress(epoch=2, step=3, steps=25, global_step=53)))
    live.on_line("worker-0", "progress epoch=2 step=4/25 global_step=99 loss=1.4000")  # human text: not read
    assert live._records == [{"epoch": 1, "global_step": 50, "train_loss": 1.5, "val_accuracy": 0.5}]
    assert (live.cost.start_step, live.cost.reached) == (40, 53)


def test_outcomes():
    assert outcome_of(None) == ("succeeded", "")
    assert outcome_of(RuntimeError("worker-1 failed")) == ("failed", "worker-1 failed")
    assert outcome_of(KeyboardInterrupt())[0] == "stopped"
