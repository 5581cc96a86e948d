"""The planner's time model: what a parameter-server job costs in time, CPU and memory, built
from per-role, per-message and per-byte costs measured by this project's benchmarks.

``infra.planning`` sizes the hardware (memory per device, how many servers); this module
predicts what a job of ``W`` workers and ``S`` servers then does: its communication per step,
its start, its supervisor's load, how fast a failure is seen, its checkpoint's size, save and
restore time, and the data step's time with ``N`` mapped parts. Every constant below is fitted
on a recorded measurement, and the comment beside it names the benchmark and the figure it came
from; ``benchmarks/predicted.py`` puts each prediction beside its measurement in the report.

**Communication** (``comm_s``). MXNet 1.9's dist kvstore places each array on the servers by
its key (``server_pieces``: whole on server ``(key * 9973) % S`` below
``MXNET_KVSTORE_BIGARRAY_BOUND`` values, else cut into ``S`` parts); in ``dist_sync`` every
worker pushes every piece and pulls it back each step. Two kinds of network:

- *Dedicated links* (each server and each worker on a host link of its own, ``Link``). A link is
  full duplex: pushes flow into a server while pulls flow out. ps-lite pipelines by key: the
  pull of a piece starts once every worker's push of it is in, while later pieces are still
  being pushed. That is a two-stage flow shop whose makespan is the inbound bytes plus the
  outbound bytes of the largest piece: ``W · (B_s + m_s) · 4 · FRAME_OVERHEAD / rate`` on
  server ``s`` holding ``B_s`` values, largest piece ``m_s``; one array is the old serial
  bound (``2 · W · B · 4``), many small ones approach the one-direction time. A token-bucket
  link (``burst_bytes``, as ``tc tbf``) passes a bucket of bytes at once in each direction,
  full at the step's start and again while the largest piece is pushed. With more servers
  than workers, a worker's own link (``B + m`` over all pieces, one worker's bytes) is the
  limit. The slowest server ends the step.
- *One shared host* (every role on this machine's loopback, ``Link(shared=True)``). Every push
  and pull crosses the loopback once, and what bounds it is the cores' copying, not a wire:
  ``LOOPBACK_PS_COST · W · 2 · P · 4 / rate`` with ``rate`` one TCP stream's loopback rate
  measured at the time (which also catches the machine's load then).

On either, each piece costs ``PER_KEY_S`` of round trips per step (ps-lite messages, the
server's bookkeeping): what a small model's step is made of.

**Shared cores** (``fair_share``). On one host, a CPU-bound phase run by ``k`` processes that
want a core each on ``C`` cores takes ``max(1, k / C)`` times its time alone: how the
restore of ``W`` workers, a save beside a training job, and parts of the data step are
predicted on this 2-core machine.

No Airflow, no mxnet, no training here (the import direction): a constant the trainer owns
(the supervisor's poll) is a parameter whose default a unit test checks against the trainer.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WIRE_BYTES = 4  # kvstore pushes and pulls fp32 arrays
DEFAULT_BIGARRAY_BOUND = 1_000_000  # MXNET_KVSTORE_BIGARRAY_BOUND's default in MXNet 1.9

# A TCP segment of 1448 payload bytes (MTU 1500, timestamps on) travels as a 1514-byte Ethernet
# frame, and a link's rate (and tc tbf, which counts frames) is in frame bytes. N1's server host
# counted 692-737 kB per step for 680 kB of arrays (benchmarks/results.json, N1 raw), and 2.53 MB
# for 2.41 MB, 1.05, with the 512×512 MLP (benchmarks/figures/constrained_links-512x512.json).
FRAME_OVERHEAD = 1514 / 1448
# Loopback: seconds of ps-lite + MXNet per byte ÷ a raw TCP stream's, on one shared host.
# Fitted on the 100 M model over 4 servers (benchmarks/figures/big_model-100m.json: 1.451 s
# measured communication ÷ 0.633 s of 1.61 GB at 2.55 GB/s = 2.29; big_model-100m-run-b.json:
# 5.689 ÷ 2.983 = 1.91), the mean. Each byte is copied by the kernel on both ends as in the raw
# stream, then by ZMQ/MXNet into an array and summed on the server: about twice the copying.
LOOPBACK_PS_COST = 2.1
# Per piece and step (a push and a pull through the server): fitted on the (64, 64) MLP over 4
# servers (benchmarks/figures/big_model-mlp64x64.json: 7.8 ms step − 2.6 ms compute = 5.15 ms of
# communication for 6 pieces, of which 0.17 ms is bytes at the loopback rate): 0.83 ms a piece.
PER_KEY_S = 0.00083

# Start: time to the first step = JOB_START_S + ROLE_START_CPU_S · roles on a host ÷ its cores.
# Least squares on benchmarks/many_roles.json (8 jobs of 5-33 processes on 2 cores): 4.25 s +
# 0.848 s per process, i.e. 1.70 CPU-s per role (importing mxnet is about 1.5 of it).
JOB_START_S = 4.25
ROLE_START_CPU_S = 1.70
# Supervisor (benchmarks/many_roles.json, 8 jobs, least squares): CPU = base + a cost per role
# and second of the job (its poll and log relay of each role); peak RSS flat plus a little per
# role; one relay thread and one pipe per role.
SUPERVISOR_CPU_BASE_S = 0.50
SUPERVISOR_CPU_PER_ROLE_S = 1.45e-4  # CPU-s per role per second of the job
SUPERVISOR_RSS_MB = 58.2
SUPERVISOR_RSS_PER_ROLE_MB = 0.028
SUPERVISOR_BASE_THREADS = 3
SUPERVISOR_BASE_FDS = 4
# Failure detection: the next poll of the supervisor (uniform over POLL_S: half of it on
# average) plus its own handling. benchmarks/many_roles.json: mean of the 16 kills 0.157 s with
# the launcher's 0.2 s poll, so 0.057 s of handling.
LAUNCHER_POLL_S = 0.2  # training.launch.launcher.POLL_S (a unit test keeps them equal)
DETECT_HANDLING_S = 0.057

# Checkpoints. Save (serialise, hash, put, commit) at P3's rate: benchmarks/results.json P3,
# 89.5 MB of ResNet-18 params + states at 134 MB/s to SeaweedFS. Restore (read, verify, load) at
# P3's 89.5 MB in 0.216 + 0.430 s = 138.5 MB/s.
SAVE_BYTES_PER_S = 134e6
RESTORE_BYTES_PER_S = 138.5e6
# A save's own CPU beside its bytes (thread, np.savez, pickle, hash pool, three files and the
# manifest, the prune's listing): 3.3-3.5 ms in the writer thread for the digits MLP's 31 kB
# checkpoint (and its 50 kB state.json) on the quiet machine, 60 saves alone, two runs
# (benchmarks/save_alone.py; wall 3.7-4.0 ms).
SAVE_CPU_S = 0.0035
# Inside a job a save is not its CPU: it waits for the engine's copies of the step's arrays, for
# the GIL the loop's next step holds, for its hash thread. Fitted (the mean) on the sizes of
# benchmarks/many_roles.json whose workers are idle by then (3+1, 6+2, 12+4: 13.7, 15.6, 15.4 ms,
# a run with other work on the machine; on the quiet machine the 3+1 save took 8.9 ms,
# benchmarks/figures/many_roles-d.json).
SAVE_LATENCY_S = 0.0149
# The others are not asleep while rank 0 saves. Every worker reads its losses back at a
# checkpoint's step (training.checkpoint.manager: ``due`` answers alike on every rank), so the
# workers other than rank 0, which run ahead queueing their steps, all wait there and are then
# released together: each runs SAVE_BURST_CPU_S of queued work at once, and every one of them
# is runnable. The burst starts SAVE_BURST_LEAD_S (about one step: rank 0's read-back of its
# losses, then its save) before the save. Both from the run queue sampled every 10 ms around job
# B's 57 saves at 24+8 (many_roles-d.json: 15-22 threads runnable from 0.12 s before a save to
# 0.06 s after it, 2-4 outside): 0.18 s of 2 cores for 19 workers, 19 ms each.
SAVE_BURST_CPU_S = 0.019
SAVE_BURST_LEAD_S = 0.12
# Restore's own CPU beside the bytes (build the model, fetch the shard list): fitted on
# benchmarks/many_roles.json 24+8: 0.53 s for 24 workers on 2 cores = 12 × (0.044 + 31 kB at
# 138.5 MB/s), the checkpoint being the digits MLP's 31 kB of arrays (the 1.7 MB of that file's
# "bytes" are 55 saves' together). Below the cores' limit a restore still takes
# RESTORE_LATENCY_S (3+1 and 6+2 measured 0.16 and 0.12 s).
RESTORE_CPU_S = 0.044
RESTORE_LATENCY_S = 0.14

# The data step (``data_checks.parts``), per task and per MB of CSV source, fitted on the 1-part
# run of the quiet machine (benchmarks/figures/mapped_shard-112mb-d.json: 111.8 MB, 256 float32
# columns, 2.5 threads runnable, the job's own). A task's start (interpreter, imports, until its
# function runs) is its wall less its work: plan 0.60, count 0.64, shard 0.76, merge 0.69 s, the
# mean. Plan reads none of the source past its first block (the listing, the layout's probe, the
# plan's put): its work, 0.65 s, is a task's setup at zero bytes (S3 clients, a plan read or
# written, a reader's first block), which every count, shard and merge task does too
# (SHARD_SETUP_S); the rest of their work is per MB: count 2.15, shard 3.23, merge 1.41 s of
# work, less 0.65 s each. Runs a, b and c (mapped_shard-112mb.json, -b, -c) shared the machine
# with other work: their 1 part took 1.8-4.8× d's, which this quiet fit does not know (their
# table lines say "loaded host").
TASK_START_S = (0.60 + 0.64 + 0.76 + 0.69) / 4
SHARD_PLAN_S = 0.65
SHARD_SETUP_S = SHARD_PLAN_S
SHARD_COUNT_S_PER_MB = (2.15 - SHARD_SETUP_S) / 111.8
SHARD_PART_S_PER_MB = (3.23 - SHARD_SETUP_S) / 111.8
# Two terms the 112 MB CSV could not show, both fitted on the 20.2 GB Parquet run of
# benchmarks/big_data.py (big_data.json, 2 parts side by side, the machine the run's alone):
# - A Parquet source's count reads the label column alone (columnar: the features' bytes are
#   skipped): 49.0 s (the two counts' mean; a task's start and setup less) for 10,109 MB a part,
#   against the CSV constant's 136 s (0.35 × its time per MB).
# - The merge's work follows the shards' bytes, not the source's: it downloads each piece,
#   writes the shard, hashes and uploads it. 307.2 s (start and setup less) for 21,292 MB of
#   records (39.1 M rows × 544 B): 70 MB/s. The same constant gives d's CSV merge (42.2 MB of
#   records from 111.8 MB of text) 1.93 s against 2.10 s measured, and the 1 GiB Parquet run's
#   17.7 s against 16.0 s. A record is 32 B of framing and header plus 4 B a value
#   (common.record_codec): 0.378 MB of shards per MB of the 256-column CSV (2,795 B a row of
#   text), 1.053 per MB of the float32 Parquet (516.5 B a row).
SHARD_COUNT_PARQUET_S_PER_MB = (49.0 - TASK_START_S - SHARD_SETUP_S) / (20217.6 / 2)
SHARD_MERGE_S_PER_SHARD_MB = (307.2 - TASK_START_S - SHARD_SETUP_S) / (39_140_250 * 544 / 1e6)
SHARD_MB_PER_SOURCE_MB = {"csv": 40_000 * (32 + 4 * 256) / 1e6 / 111.8, "parquet": 544 / 516.5}
# A part is a chain, not a pool of threads: pyarrow's streaming CSV reader (``open_csv``, what a
# part reads with) is single-threaded, and the bytes come from the S3 server, which serves them
# while the part waits. On the quiet machine (mapped_shard-112mb-d.json) the 1-part count and
# shard kept 1.27 cores busy: 3.41 + 5.21 CPU-s (their tasks and SeaweedFS) over 2.79 + 3.99 s.
# A part given fewer cores slows by SHARD_PART_CORES / its cores; more cores do not speed it up.
# Only the per-MB work is stretched: a task's start and setup are one thread's.
SHARD_PART_CORES = 1.27
# CPU seconds of the whole data step (every task and the S3 server on the same cores), from the
# quiet run d's CPU clocks (wait4 of each task, psutil of SeaweedFS): 12.29 CPU-s for 111.8 MB in
# 1 part. Each further part adds its two tasks' fixed CPU (interpreter, imports, S3 clients, the
# plan and counts read: 2.19 CPU-s, d's 2 parts' count + shard tasks less its 1 part's), and its
# boundary makes both count and shard fetch SHARD_PROBE_MB again (the line-start probes and the
# header each pull an 8 MB readahead block: 139.9 MB fetched for 111.8 MB, benchmarks/range_reads.py)
# at the server's 0.0122 CPU-s per MB (d's count: SeaweedFS 1.36 CPU-s for 111.8 MB).
# The 1 part's own fixed CPU stays inside SHARD_CPU_S_PER_MB: this model gives the ratio of
# 2 parts to 1 at the measured size, not the CPU of a much larger source.
SHARD_CPU_S_PER_MB = 12.29 / 111.8
SHARD_PART_CPU_S = 2.19
SHARD_PROBE_MB = 28.1
STORE_CPU_S_PER_MB = 0.0122


@dataclass(frozen=True)
class Link:
    """A role's network: ``bytes_per_s`` in each direction (full duplex), a token bucket of
    ``burst_bytes`` (``tc tbf``; 0 for a plain link), or ``shared``: every role on one host."""

    bytes_per_s: float
    burst_bytes: float = 0.0
    shared: bool = False


def _c_round(x: float) -> int:
    """C's ``round`` (halves away from zero), which MXNet uses; Python's rounds halves to even."""
    return math.floor(x + 0.5)


def server_pieces(sizes: Sequence[int], servers: int, bound: int = DEFAULT_BIGARRAY_BOUND) -> list[list[int]]:
    """The pieces (values) each ps-lite server rank holds under MXNet 1.9's rule
    (``src/kvstore/kvstore_dist.h``, ``EncodeDefaultKey``), keys numbered 0, 1, … in the
    Trainer's order: below ``bound`` an array goes whole to ``(key * 9973) % servers``; else it
    is cut into ``servers`` contiguous parts of ``round(size / n * (i + 1)) - round(size / n * i)``."""
    per: list[list[int]] = [[] for _ in range(servers)]
    for key, size in enumerate(sizes):
        if size < bound:
            per[(key * 9973) % servers].append(size)
        else:
            for i in range(servers):
                per[i].append(_c_round(size / servers * (i + 1)) - _c_round(size / servers * i))
    return per


def server_elements(sizes: Sequence[int], servers: int, bound: int = DEFAULT_BIGARRAY_BOUND) -> list[int]:
    """Values each server rank holds (``server_pieces`` summed)."""
    return [sum(p) for p in server_pieces(sizes, servers, bound)]


def bandwidth_s(sizes: Sequence[int], workers: int, servers: int, link: Link,
                bound: int = DEFAULT_BIGARRAY_BOUND) -> float:
    """Seconds a ``dist_sync`` step's bytes take on ``link`` (module docstring), no per-piece cost."""
    if workers < 1 or servers < 1:
        raise ValueError("workers and servers must be >= 1")
    if link.shared:
        return LOOPBACK_PS_COST * workers * 2 * sum(sizes) * WIRE_BYTES / link.bytes_per_s
    pieces = server_pieces(sizes, servers, bound)
    frame = WIRE_BYTES * FRAME_OVERHEAD
    burst = link.burst_bytes

    def pipelined(inbound: float, largest: float) -> float:
        # Inbound, then the largest piece's way back; each direction's bucket passes its bytes at once.
        return max(inbound + largest - 2 * burst, inbound - burst, 0.0) / link.bytes_per_s

    per_server = [pipelined(workers * sum(p) * frame, workers * max(p) * frame) for p in pieces if p]
    everything = [x for p in pieces for x in p]
    per_worker = pipelined(sum(everything) * frame, max(everything) * frame)
    return max(per_server + [per_worker])


def comm_s(sizes: Sequence[int], workers: int, servers: int, link: Link,
           bound: int = DEFAULT_BIGARRAY_BOUND) -> float:
    """Seconds of communication per step: the bytes (``bandwidth_s``) plus ``PER_KEY_S`` per piece
    a worker pushes and pulls."""
    pieces = sum(len(p) for p in server_pieces(sizes, servers, bound))
    return bandwidth_s(sizes, workers, servers, link, bound) + PER_KEY_S * pieces


def fair_share(busy: float, cores: int) -> float:
    """How much longer a CPU-bound phase takes when ``busy`` processes want a core each on ``cores``."""
    return max(1.0, busy / cores)


def first_step_s(roles_per_host: int, cores_per_host: int) -> float:
    """Job start → the first step: the roles of a host start (import mxnet, join ps-lite) on its cores."""
    return JOB_START_S + ROLE_START_CPU_S * roles_per_host / cores_per_host


def supervisor_cpu_s(roles: int, job_s: float) -> float:
    """The supervisor's CPU seconds over a job of ``roles`` processes lasting ``job_s``."""
    return SUPERVISOR_CPU_BASE_S + SUPERVISOR_CPU_PER_ROLE_S * roles * job_s


def supervisor_rss_mb(roles: int) -> float:
    return SUPERVISOR_RSS_MB + SUPERVISOR_RSS_PER_ROLE_MB * roles


def supervisor_threads(roles: int) -> int:
    return SUPERVISOR_BASE_THREADS + roles


def supervisor_fds(roles: int) -> int:
    return SUPERVISOR_BASE_FDS + roles


def detect_s(poll_s: float = LAUNCHER_POLL_S) -> float:
    """Mean time from a role's death to the supervisor's ``role_failed``."""
    return poll_s / 2 + DETECT_HANDLING_S


def checkpoint_bytes(params: int, state_values: int, aux: int = 0) -> int:
    """A checkpoint's bytes: fp32 parameters, ``state_values`` optimizer values per parameter
    (the optimizer on the workers: its state is saved too) and aux state."""
    return (params * (1 + state_values) + aux) * 4


def save_s(nbytes: float, busy: float = 1.0, cores: int = 1) -> float:
    """One checkpoint save (serialise, hash, put, commit) with ``busy`` processes (or measured
    runnable threads) wanting ``cores``."""
    return (SAVE_CPU_S + nbytes / SAVE_BYTES_PER_S) * fair_share(busy, cores)


def checkpoint_step_save_s(nbytes: float, workers: int, cores: int) -> float:
    """Rank 0's save in a ``dist_sync`` job of ``workers`` on ``cores`` shared by all, the other
    workers released together at the checkpoint's step (module constants). While their burst
    lasts the save is one of ``workers`` runnable threads; once it is over (or if it ended before
    the save began) the save runs alone, never under the in-job latency ``SAVE_LATENCY_S``."""
    others = workers - 1
    own = save_s(nbytes)
    left = others * SAVE_BURST_CPU_S / cores - SAVE_BURST_LEAD_S  # the burst's wall time still to run
    if left <= 0:
        return max(SAVE_LATENCY_S, own)
    shared = own * fair_share(others + 1, cores)
    if shared > left:  # the burst ends first: the rest of the save alone
        shared = left + own - left * cores / (others + 1)
    return max(SAVE_LATENCY_S, shared)


def restore_s(nbytes: float, workers: int, cores: int, storage_procs: int = 0,
              runnable: float | None = None) -> float:
    """Every worker reads, verifies and loads the checkpoint itself, at once: on one host of
    ``cores`` with ``storage_procs`` storage servers beside them (a local S3: 1) they share the
    cores; alone (one worker per host: ``workers=1``) a restore is its own CPU or the latency.
    ``runnable``: the threads measured wanting the cores meanwhile (others' work included), in
    place of the job's own count."""
    cpu = RESTORE_CPU_S + nbytes / RESTORE_BYTES_PER_S
    busy = runnable if runnable is not None else workers + storage_procs
    return max(RESTORE_LATENCY_S, cpu * fair_share(busy, cores))


def shard_steps_s(source_mb: float, parts: int, cores_per_part: float = 2.0, source_format: str = "csv",
                  shard_mb: float | None = None) -> dict[str, float]:
    """The data step's tasks, each from its start to its end: plan, a part's count, a part's shard
    (the parts side by side), the merge. ``parts`` mapped parts, each a task with
    ``cores_per_part`` cores (its own Airflow worker's; N parts side by side on a C-core host:
    C / N), the cores otherwise free. Each task starts (``TASK_START_S``); count, shard and merge
    each do a fixed setup (``SHARD_SETUP_S``) before their bytes. A part is a chain that keeps
    ``SHARD_PART_CORES`` busy. A Parquet source's count reads one column; the merge's work is per
    MB of shards written, ``shard_mb`` (default: the measured tables' ratio to the source, module
    constants)."""
    if source_format not in SHARD_MB_PER_SOURCE_MB:
        raise ValueError(f"source_format must be 'csv' or 'parquet', not {source_format!r}")
    stretch = max(1.0, SHARD_PART_CORES / cores_per_part)
    count_per_mb = SHARD_COUNT_PARQUET_S_PER_MB if source_format == "parquet" else SHARD_COUNT_S_PER_MB * stretch
    if shard_mb is None:
        shard_mb = source_mb * SHARD_MB_PER_SOURCE_MB[source_format]
    part_mb = source_mb / parts
    return {"plan": TASK_START_S + SHARD_PLAN_S,
            "count": TASK_START_S + SHARD_SETUP_S + part_mb * count_per_mb,
            "shard": TASK_START_S + SHARD_SETUP_S + part_mb * SHARD_PART_S_PER_MB * stretch,
            "merge": TASK_START_S + SHARD_SETUP_S + shard_mb * SHARD_MERGE_S_PER_SHARD_MB}


def shard_s(source_mb: float, parts: int, cores_per_part: float = 2.0, source_format: str = "csv",
            shard_mb: float | None = None) -> float:
    """The data step, plan → merge: its four steps one after another (``shard_steps_s``)."""
    return sum(shard_steps_s(source_mb, parts, cores_per_part, source_format, shard_mb).values())


def shard_cpu_s(source_mb: float, parts: int) -> float:
    """CPU seconds of the whole data step in ``parts`` parts, the S3 server's included: what it
    takes on a host whose cores, not its chains, bound it (other work on them). Every part past
    the first adds its tasks' fixed CPU and the bytes its boundary fetches twice more."""
    extra = (parts - 1) * (SHARD_PART_CPU_S + 2 * SHARD_PROBE_MB * STORE_CPU_S_PER_MB)
    return source_mb * SHARD_CPU_S_PER_MB + extra
