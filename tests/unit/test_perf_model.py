"""The planner's time model (``infra.perf_model``): every expected figure below is worked out by
hand from the formulas of its docstring, not copied from the code's output."""
from __future__ import annotations

import pytest

from infra import perf_model as pm
from training.launch import launcher

pytestmark = pytest.mark.unit

F = 1514 / 1448  # an Ethernet frame per TCP payload


def test_keys_go_whole_below_the_bound_and_in_parts_above_it():
    # 9973 % 4 == 1: key k of a small array goes to server k % 4.
    assert pm.server_pieces([5, 7, 11, 13, 17], 4, bound=100) == [[5, 17], [7], [11], [13]]
    # 10 values over 4 servers, C's rounding: 2.5 → 3, 5, 7.5 → 8, 10.
    assert pm.server_pieces([10], 4, bound=10) == [[3], [2], [3], [2]]
    assert pm.server_elements([5, 7, 11, 13, 17], 4, bound=100) == [22, 7, 11, 13]


def test_a_dedicated_link_is_full_duplex_and_pipelined_by_key():
    # 2 workers, 1 server, arrays of 1000 and 250 values at 1 MB/s: the server takes in
    # 2 · 1250 · 4 = 10,000 bytes while sending back, then the largest array's 2 · 1000 · 4 = 8,000.
    link = pm.Link(1e6)
    assert pm.bandwidth_s([1000, 250], 2, 1, link, bound=10**9) == pytest.approx(18_000 * F / 1e6)
    # One array: nothing to overlap, the serial bound 2 · W · B · 4 (pushes, then pulls).
    assert pm.bandwidth_s([1250], 2, 1, link, bound=10**9) == pytest.approx(20_000 * F / 1e6)
    # A token bucket of 1,000 bytes passes that much at once in each direction.
    assert pm.bandwidth_s([1000, 250], 2, 1, pm.Link(1e6, burst_bytes=1000), bound=10**9) == pytest.approx(
        (18_000 * F - 2000) / 1e6)


def test_with_more_servers_than_workers_a_workers_link_is_the_limit():
    # 4 M values cut in 4 parts of 1 M; one worker's link carries all 4 M out and the last 1 M back
    # (5 M · 4 bytes) while each server carries 1 M in and 1 M out (2 M · 4).
    assert pm.bandwidth_s([4_000_000], 1, 4, pm.Link(1e8)) == pytest.approx(20e6 * F / 1e8)


def test_one_shared_host_is_bound_by_copying_every_byte():
    # Every push and pull crosses the loopback once: 2 workers · 2 · 1250 · 4 = 20,000 bytes, at
    # 2.1 times a raw stream's cost.
    assert pm.bandwidth_s([1000, 250], 2, 4, pm.Link(1e6, shared=True)) == pytest.approx(2.1 * 0.02)


def test_each_piece_costs_a_round_trip_per_step():
    bw = pm.bandwidth_s([1000, 250], 2, 2, pm.Link(1e6), bound=10**9)
    assert pm.comm_s([1000, 250], 2, 2, pm.Link(1e6), bound=10**9) == pytest.approx(bw + 2 * 0.00083)
    # An array above the bound is 4 pieces over 4 servers.
    assert pm.comm_s([2_000_000], 2, 4, pm.Link(1e9)) - pm.bandwidth_s([2_000_000], 2, 4, pm.Link(1e9)) == \
        pytest.approx(4 * 0.00083)


def test_n1_at_50_mbit_by_hand():
    # The N1 job: MLP 64 → 256 → 256 → 10 (85,002 values, largest array 65,536), 2 workers, one
    # server, tbf at 50 Mbit/s (6.25 MB/s) with a 25,000-byte bucket.
    sizes = [64 * 256, 256, 256 * 256, 256, 256 * 10, 10]
    inbound, largest = 2 * 85_002 * 4, 2 * 65_536 * 4
    expected = ((inbound + largest) * F - 2 * 25_000) / 6.25e6
    assert pm.bandwidth_s(sizes, 2, 1, pm.Link(6.25e6, burst_bytes=25_000)) == pytest.approx(expected)
    assert expected == pytest.approx(0.1935, abs=1e-4)


def test_start_supervisor_and_detection():
    assert pm.first_step_s(33, 2) == pytest.approx(4.25 + 1.70 * 33 / 2)  # 32.3 s
    assert pm.first_step_s(1, 8) == pytest.approx(4.25 + 1.70 / 8)  # a role alone on its host
    assert pm.supervisor_cpu_s(33, 100) == pytest.approx(0.50 + 1.45e-4 * 3300)
    assert pm.supervisor_rss_mb(100) == pytest.approx(58.2 + 2.8)
    assert (pm.supervisor_threads(33), pm.supervisor_fds(33)) == (36, 37)
    assert pm.detect_s() == pytest.approx(0.1 + 0.057)
    assert pm.detect_s(1.0) == pytest.approx(0.5 + 0.057)


def test_the_detection_model_uses_the_launchers_poll():
    assert pm.LAUNCHER_POLL_S == launcher.POLL_S


def test_checkpoint_size_save_and_restore():
    assert pm.checkpoint_bytes(100, 1, aux=10) == (200 + 10) * 4
    assert pm.checkpoint_bytes(100_760_010, 1) == 806_080_080  # the 100 M model with momentum
    assert pm.save_s(134e6) == pytest.approx(1.0035)  # the bytes, and 3.5 ms of the save's own CPU
    assert pm.save_s(134e6, busy=6, cores=2) == pytest.approx(3 * 1.0035)  # six processes want the two cores
    assert pm.save_s(134e6, busy=1, cores=2) == pytest.approx(1.0035)
    # 138.5 MB: 1 s of reading, verifying and loading, plus 0.044 s of the restore's own CPU.
    assert pm.restore_s(138.5e6, workers=1, cores=4) == pytest.approx(1.044)
    assert pm.restore_s(138.5e6, workers=2, cores=2, storage_procs=1) == pytest.approx(1.044 * 1.5)
    assert pm.restore_s(1000, workers=1, cores=2) == pytest.approx(0.14)  # the latency floor


def test_a_save_at_the_checkpoint_step_shares_the_cores_with_the_released_workers():
    own = pm.save_s(31_000)  # the digits MLP's checkpoint: 3.5 ms of CPU, 0.2 ms of bytes
    # 2, 5, 10 workers: their burst (19 ms each on 2 cores) is over within the 0.12 s before the
    # save: the save takes its in-job latency.
    for workers in (2, 5, 10):
        assert pm.checkpoint_step_save_s(31_000, workers, 2) == pytest.approx(pm.SAVE_LATENCY_S)
    # 20 workers: 19 × 19 ms on 2 cores outlast the 0.12 s lead by 60 ms; the save is one of 20
    # runnable threads throughout: 10 times its own time.
    assert pm.checkpoint_step_save_s(31_000, 20, 2) == pytest.approx(own * 10)
    # 14 workers: the burst has 3.5 ms left; the save gets 2/14 of the cores for it, then runs alone.
    left = 13 * 0.019 / 2 - 0.12
    assert pm.checkpoint_step_save_s(31_000, 14, 2) == pytest.approx(max(pm.SAVE_LATENCY_S, left + own - left * 2 / 14))
    # More cores end the burst sooner.
    assert pm.checkpoint_step_save_s(31_000, 20, 8) == pytest.approx(pm.SAVE_LATENCY_S)


def test_sharding_time_with_mapped_parts():
    # Quiet run d's 1 part, 111.8 MB of CSV: 4 task starts (wall less work, mean 0.6725 s), plan
    # 0.65 s of work, which is also the fixed setup of count, shard and merge; per MB: count
    # 1.50 s + shard 2.58 s over the parts; the merge per MB of shards (40,000 records of 1,056 B:
    # 42.24 MB) at the 20.2 GB run's rate, 1.93 s of wall against d's 2.10.
    fixed = 4 * 0.6725 + 0.65 + 3 * 0.65
    merge = 42.24 * pm.SHARD_MERGE_S_PER_SHARD_MB
    assert pm.shard_steps_s(111.8, 1)["merge"] == pytest.approx(0.6725 + 0.65 + merge)
    assert pm.shard_steps_s(111.8, 1)["merge"] == pytest.approx(1.93, abs=0.005)
    assert pm.shard_s(111.8, 1) == pytest.approx(fixed + 4.08 + merge)
    assert pm.shard_s(111.8, 2) == pytest.approx(fixed + 4.08 / 2 + merge)  # 2 workers of 2 cores
    # A part is a chain keeping 1.27 cores busy: more cores do not speed it up...
    assert pm.shard_s(111.8, 4, cores_per_part=8) == pytest.approx(fixed + 4.08 / 4 + merge)
    # ...and two side by side on a quiet 2-core host, a core each, run half the bytes 1.27× slower;
    # their tasks' start and setup are not split by the parts.
    assert pm.shard_s(111.8, 2, cores_per_part=1) == pytest.approx(fixed + 4.08 / 2 * 1.27 + merge)
    assert pm.shard_s(111.8, 2, cores_per_part=1) / pm.shard_s(111.8, 1) == pytest.approx(0.85, abs=0.01)
    # At zero bytes a step is its tasks' starts, plan and setups.
    assert pm.shard_s(0.0, 1) == pytest.approx(fixed)


def test_sharding_a_parquet_source():
    # big_data.json's 20.2 GB Parquet run, 2 parts on 2 cores: its count (49.0 s) and merge
    # (307.2 s, 39.1 M records of 544 B) are the fitted terms; the parts' shard keeps the CSV
    # constant, 1.27× on a core each.
    steps = pm.shard_steps_s(20217.6, 2, cores_per_part=1, source_format="parquet")
    assert steps["count"] == pytest.approx(49.0)
    assert steps["merge"] == pytest.approx(307.2, abs=0.1)
    assert steps["shard"] == pytest.approx(pm.TASK_START_S + 0.65 + 10108.8 * 2.58 / 111.8 * 1.27)
    assert sum(steps.values()) == pytest.approx(pm.shard_s(20217.6, 2, 1, "parquet"))
    # A CSV's count parses every byte: 2.8× the Parquet count's time per MB.
    assert pm.shard_steps_s(20217.6, 2, 1)["count"] > 2.5 * steps["count"]
    # The merge follows the shards' bytes: a CSV's text makes 0.378 MB of records per MB, float32
    # Parquet 1.053; given, the shards' MB decide.
    fixed = pm.TASK_START_S + pm.SHARD_SETUP_S
    assert (pm.shard_steps_s(1000, 1, source_format="parquet")["merge"] - fixed) / (
        pm.shard_steps_s(1000, 1)["merge"] - fixed) == pytest.approx(1.053 / 0.378, rel=1e-3)
    assert pm.shard_steps_s(1000, 1, shard_mb=500)["merge"] == pytest.approx(
        pm.shard_steps_s(1000, 1, source_format="parquet", shard_mb=500)["merge"])
    with pytest.raises(ValueError, match="source_format must be 'csv' or 'parquet', not 'orc'"):
        pm.shard_steps_s(1.0, 1, source_format="orc")


def test_sharding_cpu_on_a_loaded_host():
    # Quiet run d's CPU clocks: 12.29 CPU-s in 1 part; a second part adds 2.19 CPU-s of its tasks
    # and 2 × 28.1 MB fetched again at the server's 0.0122 CPU-s per MB.
    assert pm.shard_cpu_s(111.8, 1) == pytest.approx(12.29)
    assert pm.shard_cpu_s(111.8, 2) == pytest.approx(12.29 + 2.19 + 2 * 28.1 * 0.0122)
    # Where the cores bound the step, a second part costs 23 %: runs a and b measured 27 %.
    assert pm.shard_cpu_s(111.8, 2) / pm.shard_cpu_s(111.8, 1) == pytest.approx(1.234, abs=1e-3)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="workers and servers"):
        pm.bandwidth_s([10], 0, 1, pm.Link(1e6))
