"""Context parallel (cp > 1): each rank of a cp group holds a share of every sequence.

The layout (`parallelize.build_mesh`, torchtitan's order): the mesh has a `cp`
dimension between `dp_shard` and `tp`; FSDP2 shards parameters over
dp_shard x cp (the flattened `dp_shard_cp` dimension, `fsdp_mesh`), because
the ranks of a cp group hold the same weights and see different tokens, so to
the gradient they are data parallel. The cp ranks of one replica read the same
sequences (`parallelize.dp_coordinates` ignores cp) and each keeps its share.

The step (`shard_sequences`): forward and backward run inside PyTorch's
`torch.distributed.tensor.experimental.context_parallel`, which shards the
input ids, the labels and the model's rotary tables (`Transformer.rope_cos`,
`rope_sin`, sequence dim 0) in place along the sequence, and swaps
`F.scaled_dot_product_attention` for ring attention over the cp group. With
causal attention a plain split would give the last rank all the work; the
head-tail order (`head_tail_positions`: chunk i and chunk 2 cp - 1 - i of 2 cp
equal chunks) gives every rank the same number of (query, key) pairs, and
needs seq_len divisible by 2 cp.

The loss: each rank's cross-entropy is the mean over its seq_len / cp tokens.
The shares are equal, so the mean over all tokens (sum of shard sums over the
total count, `reassemble_mean`) is the plain mean of the shard means: what
`step.reduce_loss` reports (mean over ranks) and, for the gradient, what
FSDP2's reduce-scatter computes (it averages over the dp_shard x cp ranks).

GPU only: on CPU, SDPA's kernel has no sharding rule (torch 2.13) and the math
path mixes Tensor and DTensor. The pure functions are tested on CPU
(tests/bench/test_context_parallel.py), the GPU parity by `bench.cp_parity`;
torch is imported lazily, so the CLI reads `NEEDS_CUDA` without starting it.
"""

from __future__ import annotations

import contextlib

from trainplan.errors import LayoutError

NEEDS_CUDA = ("context parallel runs on GPUs only: PyTorch's ring attention has no CPU "
              "(gloo) path")


# ---------------------------------------------------------------- which tokens a rank holds


def head_tail_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """Token positions (0-based, ascending within each chunk) that cp rank `rank` holds.

    The sequence is cut into 2 cp chunks of seq_len / (2 cp) tokens; rank i
    holds chunk i and chunk 2 cp - 1 - i, in that order: the order in which
    `context_parallel` lays out a rank's shard (its head-tail load balancer),
    so these are also the rank's position ids.
    """
    if cp < 1 or not 0 <= rank < cp:
        raise LayoutError(f"cp rank {rank} of cp = {cp}: use cp >= 1 and 0 <= rank < cp")
    if seq_len % (2 * cp):
        raise LayoutError(f"seq_len = {seq_len} is not divisible by 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return list(range(head, head + chunk)) + list(range(tail, tail + chunk))


def sequence_order(seq_len: int, cp: int) -> list[int]:
    """The permutation of 0..seq_len-1 whose cp equal consecutive pieces are the ranks' shares."""
    return [p for r in range(cp) for p in head_tail_positions(seq_len, cp, r)]


def causal_work(positions: list[int]) -> int:
    """(query, key) pairs of causal attention for queries at `positions`: sum of (p + 1).

    The query at position p attends to keys 0..p; ring attention's FLOPs on a
    rank are proportional to this count (the masked half of a block is skipped).
    """
    return sum(p + 1 for p in positions)


def reassemble_mean(shard_sums: list[float], shard_counts: list[int]) -> float:
    """Mean loss over all tokens from each cp shard's loss sum and token count."""
    total = sum(shard_counts)
    if total <= 0:
        raise LayoutError("no tokens in any cp shard")
    return sum(shard_sums) / total


# ---------------------------------------------------------------- checks


def check_device(cp: int, device_type: str | None) -> None:
    """One line where cp > 1 is asked of CPU processes (before any process group starts)."""
    if cp > 1 and device_type == "cpu":
        raise LayoutError(f"cp = {cp}: {NEEDS_CUDA}; run on GPUs or use cp 1")


def check_cp(cfg, spec, *, seq_len: int | None = None, device_type: str | None = None) -> None:
    """Raise LayoutError, one line naming the value, for a cp > 1 layout the harness cannot run.

    `seq_len` and `device_type` are checked where the caller knows them (the
    harness and trainer do; a plan check may not).
    """
    cp = cfg.cp
    check_device(cp, device_type)
    if seq_len is not None and seq_len % (2 * cp):
        raise LayoutError(f"cp = {cp} needs --seq-len divisible by 2 x cp = {2 * cp} (head-tail "
                          f"load balancing) but it is {seq_len}; use a multiple of {2 * cp}")
    if spec.positions != "rope":
        raise LayoutError(f"cp = {cp} with {spec.name!r}: context parallel supports rotary "
                          f"positions only (it has {spec.positions!r}); use cp 1")


# ---------------------------------------------------------------- the mesh and the step


def fsdp_mesh(mesh, cfg):
    """The mesh FSDP2 shards over: dp_shard x cp (flattened); dp_replicate in front for HSDP."""
    if cfg.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if cfg.dp_shard < cfg.dp else mesh["dp_shard"]
    import warnings

    with warnings.catch_warnings():  # torch >= 2.11 warns of slicing a flattened dim from the
        warnings.simplefilter("ignore", UserWarning)  # root: still how HSDP gets a 2-D mesh
        if mesh["dp_replicate"].size() > 1:
            return mesh["dp_replicate", "dp_shard_cp"]
        return mesh["dp_shard_cp"]


def flatten_shard_cp(mesh) -> None:
    """Give `mesh` the 1-D dimension dp_shard_cp (dp_shard x cp) that FSDP2 shards over."""
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")


def rope_buffers(parts) -> list:
    """The rotary tables (seq, head_dim) of every model part: sharded with the tokens."""
    out = []
    for part in parts:
        inner = getattr(part, "module", part)
        out += [inner.rope_cos, inner.rope_sin]
    return out


def shard_sequences(par, inputs, labels, *, restore: bool = False):
    """The context that runs one forward (+ backward) on this rank's share of the sequences.

    `inputs` and `labels` (B, S) are sharded in place to (B, S / cp), in
    head-tail order, and are left so afterwards unless `restore` (evaluation
    batches are reused); the rotary tables are always restored. Attention
    kernels are limited to flash, memory-efficient and cuDNN, the ones ring
    attention implements (fp32 runs take the memory-efficient kernel). A
    no-op context without cp.
    """
    if getattr(par, "cp_mesh", None) is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _cp_options.enable_load_balance = True  # head-tail order (the default; said here)
    set_rotate_method("allgather")  # the default: gather K and V once, then compute
    stack = contextlib.ExitStack()
    stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                     SDPBackend.CUDNN_ATTENTION]))
    rope = rope_buffers(par.parts)
    stack.enter_context(context_parallel(
        par.cp_mesh, buffers=[inputs, labels, *rope],
        buffer_seq_dims=[1, 1] + [0] * len(rope),
        no_restore_buffers=set() if restore else {inputs, labels}))
    return stack
