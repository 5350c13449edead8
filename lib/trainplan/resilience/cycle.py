"""The closed forms of one checkpoint cycle: size, stall, persist time, interval, lost work, ETTR.

Pure functions of sizes and times, each citing its source, with no checks of their inputs:
`trainplan.resilience.checkpoint` checks a request and adds these up into a plan, and
`trainplan.resilience.failures` simulates the same cycle to test them.

Timeline of one checkpoint cycle (the model every formula here shares):

    |<---------------- interval I (save start to save start) ---------------->|
    | stall delta | training ...                                              |
    |<------ persist T_p ------>|  (the save is durable T_p after it starts)

The state is snapshotted when a save starts. Synchronous saves block for the
whole write (delta = T_p); asynchronous ones (PyTorch DCP `async_save`) block
only while the state is copied to host memory and write in the background
(delta = staging, T_p = staging + write). A failure loses the wall time since
the last *durable* snapshot, plus the restart R.

Units: sizes in GB (10^9 bytes, as storage bandwidth is quoted), times in
seconds unless a name says otherwise (`_min`, `_hours`).
"""

from __future__ import annotations

import math
from typing import Literal

GB = 1e9
FP32_ADAM_BYTES = 12  # fp32 master weights + Adam m + v, bytes/param (Rajbhandari et al. 2020)
BF16_WEIGHT_BYTES = 2  # the bf16 working copy, when it is saved too (12 + 2 = 14 bytes/param)
HOST_COPY_GBPS = 25.0  # ASSUMPTION: GPU -> pinned host copy per GPU, GB/s (PCIe Gen5 x16 peaks
#                        near 64; 25 leaves room for pageable buffers and contention). Replace
#                        with the stall measured by the harness's checkpoint benchmark.
Mode = Literal["async", "sync"]


# ---------------------------------------------------------------- sizes


def checkpoint_bytes(n_params: int, bf16_weights: bool = False) -> float:
    """Bytes of one full checkpoint: 12 B/param (fp32 master + Adam m, v), 14 with bf16 weights.

    Rajbhandari et al. 2020 (ZeRO) for the 12. Gradients are not saved (they are rebuilt
    by the next step).
    """
    return float(n_params) * (FP32_ADAM_BYTES + (BF16_WEIGHT_BYTES if bf16_weights else 0))


# ---------------------------------------------------------------- times


def write_seconds(bytes_per_node: float, write_gbps_per_node: float) -> float:
    """Time to write one node's share to storage: size per node / write bandwidth per node.

    DCP writes each rank's shard from its own node and spreads replicated
    tensors over ranks, so every node writes total / nodes. Published per-node
    persist bandwidth on large parallel filesystems: 1-3 GB/s (reported for BLOOM and
    for Llama 3, Dubey et al. 2024).
    """
    return bytes_per_node / (write_gbps_per_node * GB)


def staging_seconds(bytes_per_gpu: float, host_copy_gbps: float = HOST_COPY_GBPS) -> float:
    """Asynchronous stall: each GPU copies its state share to host memory, state / copy rate.

    The copy rate is an assumption (`HOST_COPY_GBPS`), not a measurement.
    Published bar: 6.3 s for a 7B model with DCP `async_save` (Pasqualin et al. 2024,
    PyTorch blog "Reducing Model Checkpointing Times by Over 10x").
    """
    return bytes_per_gpu / (host_copy_gbps * GB)


def stall_seconds(mode: Mode, write_s: float, staging_s: float) -> float:
    """Time training is blocked per save: the whole write (sync) or the host copy (async)."""
    return write_s if mode == "sync" else staging_s


def persist_seconds(mode: Mode, write_s: float, staging_s: float) -> float:
    """Time from a save's start until it is durable: write (sync), staging + write (async)."""
    return write_s if mode == "sync" else staging_s + write_s


def job_mtbf(node_mtbf: float, nodes: int) -> float:
    """Job MTBF = node MTBF / nodes: independent exponential failures add their rates."""
    return node_mtbf / nodes


def outlives_restart(mtbf: float, restart: float, persist: float) -> bool:
    """Whether job MTBF M > restart R + one save's persist time T_p (s). The forms here let
    failures strike only while training (first order, R + T_p << M); at M <= R + T_p a failure
    is expected before a new checkpoint is durable, and no interval bounds the lost work (in
    Daly 2006's full model a restart alone takes M (e^(R/M) - 1) on average)."""
    return mtbf > restart + persist


# ---------------------------------------------------------------- intervals


def young_interval(delta: float, mtbf: float) -> float:
    """Young (1974): compute time between checkpoints tau = sqrt(2 delta M).

    delta = blocking time per checkpoint, M = job MTBF (any one unit for both).
    J. W. Young, "A first order approximation to the optimum checkpoint
    interval", CACM 17(9), 1974.
    """
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly (2006) eq. 37: the higher-order optimum compute time between checkpoints.

    tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta
    for delta < 2M, else tau = M. J. T. Daly, "A higher order estimate of the
    optimum checkpoint interval for restart dumps", FGCS 22(3), 2006. Published
    vectors (R = 10 min, delta = 5 min): M = 24 h -> 117 min, 6 h -> 57 min,
    15 min -> 9.1 min (tests/resilience/test_checkpoint.py).
    """
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


# ---------------------------------------------------------------- lost work and ETTR


def expected_lost(interval: float, persist: float, restart: float) -> float:
    """Expected wall time lost per failure: I/2 + T_p + R.

    A failure at a uniform point of the cycle loses the time since the last
    durable snapshot: x if x >= T_p, else I + x; the mean is I/2 + T_p (for
    T_p <= I). Then the restart R.
    """
    return interval / 2.0 + persist + restart


def worst_lost(interval: float, persist: float, restart: float) -> float:
    """Worst-case wall time lost per failure: I + T_p + R (failing just before a save is safe)."""
    return interval + persist + restart


def max_interval(max_lost: float, persist: float, restart: float) -> float:
    """The longest interval whose worst case stays within `max_lost`: max_lost - T_p - R."""
    return max_lost - persist - restart


def ettr(interval: float, stall: float, persist: float, restart: float, mtbf: float) -> float:
    """Effective training time ratio: (1 - delta / I) (M - I/2 - T_p + delta) / (M + R).

    A first-order renewal model (in the spirit of Young 1974 and Daly 2006,
    derived here, not copied): failures strike the running job at rate 1/M, so
    M + R of wall time pass per failure on average, of which L = I/2 + T_p + R
    is lost (`expected_lost`). The useful rest ends where the save that was
    under way began, so it holds one stall fewer than its share: useful time
    M - (L - R) + delta, of which 1 - delta / I trains. The simulation
    (`failures.simulate`) agrees within its standard error while M >> I
    (tests/resilience/test_failures.py). Llama 3 reports above 0.90 (Dubey et al. 2024, sec. 3.3.4).
    """
    lost_running = expected_lost(interval, persist, restart) - restart
    return (1.0 - stall / interval) * (mtbf - lost_running + stall) / (mtbf + restart)
