"""Context parallel's CPU-testable pieces (`bench.harness.context`), and its layout on gloo.

Ring attention itself needs a GPU (`trainplan.bench.cp_parity` makes that record). Here:
the head-tail order (every position once, the same causal work on every rank, the order
PyTorch's own load balancer uses), why sharding the rotary tables with the tokens is right,
the loss and gradient reassembly the step relies on, the one-line refusals, and, on 4 gloo
ranks, the mesh, the data each rank reads and a checkpoint of the layout's sharded state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainplan.bench.harness import context
from trainplan.bench.harness import parallelize as pz
from trainplan.bench.harness.model import apply_rope, rope_tables
from trainplan.errors import LayoutError
from trainplan.specs import ModelSpec, ParallelConfig

TINY = ModelSpec(name="tiny", n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn=64, vocab=128)
CASES = [(8, 1), (8, 2), (32, 2), (32, 4), (96, 3), (8192, 8)]  # (seq_len, cp)
LIB = Path(__file__).resolve().parents[2] / "lib"


@pytest.mark.parametrize("seq_len, cp", CASES)
def test_ranks_hold_every_position_exactly_once(seq_len, cp):
    held = [p for r in range(cp) for p in context.head_tail_positions(seq_len, cp, r)]
    assert sorted(held) == list(range(seq_len))
    assert all(len(context.head_tail_positions(seq_len, cp, r)) == seq_len // cp
               for r in range(cp))


@pytest.mark.parametrize("seq_len, cp", CASES)
def test_causal_work_is_the_same_on_every_rank(seq_len, cp):
    work = {context.causal_work(context.head_tail_positions(seq_len, cp, r)) for r in range(cp)}
    assert work == {seq_len * (seq_len + 1) // 2 // cp}  # the whole triangle, split evenly
    if cp > 1:  # a contiguous split, by contrast, leaves the last rank the most work
        piece = seq_len // cp
        contiguous = [context.causal_work(range(r * piece, (r + 1) * piece)) for r in range(cp)]
        assert contiguous[-1] > contiguous[0]


def test_head_tail_order_by_hand():
    assert context.head_tail_positions(8, 2, 0) == [0, 1, 6, 7]
    assert context.head_tail_positions(8, 2, 1) == [2, 3, 4, 5]
    assert context.sequence_order(8, 4) == [0, 7, 1, 6, 2, 5, 3, 4]


@pytest.mark.parametrize("seq_len, cp", CASES)
def test_order_is_pytorchs_head_tail_load_balancer(seq_len, cp):
    """`context_parallel` shards the buffers in this order; position ids must follow it."""
    lb = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    torch_order = lb._HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].tolist()
    assert context.sequence_order(seq_len, cp) == torch_order


def test_sharded_rope_tables_rotate_each_token_by_its_own_position():
    """Sharding cos/sin with the tokens gives each kept token the angles of its position."""
    seq_len, cp, head_dim = 16, 2, 8
    cos, sin = rope_tables(seq_len, head_dim)
    q = torch.randn(2, seq_len, 3, head_dim)  # (B, S, n, hd)
    whole = apply_rope(q, cos, sin)
    for r in range(cp):
        pos = torch.tensor(context.head_tail_positions(seq_len, cp, r))
        shard = apply_rope(q[:, pos], cos[pos], sin[pos])
        torch.testing.assert_close(shard, whole[:, pos], rtol=0, atol=0)


def test_reassembled_loss_is_the_full_sequence_loss():
    torch.manual_seed(0)
    seq_len, cp, vocab = 32, 4, 11
    logits, labels = torch.randn(3, seq_len, vocab), torch.randint(vocab, (3, seq_len))
    full = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    sums, counts, means = [], [], []
    for r in range(cp):
        pos = torch.tensor(context.head_tail_positions(seq_len, cp, r))
        lg, lb = logits[:, pos].flatten(0, 1), labels[:, pos].flatten()
        sums.append(F.cross_entropy(lg, lb, reduction="sum").item())
        counts.append(lb.numel())
        means.append(F.cross_entropy(lg, lb).item())
    assert context.reassemble_mean(sums, counts) == pytest.approx(full.item(), rel=1e-6)
    # equal shares: the mean of the shard means (reduce_loss over cp ranks) is the same
    assert sum(means) / cp == pytest.approx(full.item(), rel=1e-6)
    # and a wrong reassembly (the sum of the means, no division) is caught
    assert sum(means) != pytest.approx(full.item(), rel=1e-3)


def test_gradient_average_over_cp_ranks_is_the_full_gradient():
    """What the step does: each cp rank backpropagates the mean over its share; FSDP2
    averages the gradients over dp_shard x cp. That is the gradient of the full mean."""
    torch.manual_seed(1)
    seq_len, cp, hidden, vocab = 16, 2, 6, 9
    h, labels = torch.randn(2, seq_len, hidden), torch.randint(vocab, (2, seq_len))
    w = torch.randn(vocab, hidden, requires_grad=True)
    F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten()).backward()
    full = w.grad.clone()
    grads = []
    for r in range(cp):
        w.grad = None
        pos = torch.tensor(context.head_tail_positions(seq_len, cp, r))
        F.cross_entropy((h[:, pos] @ w.t()).flatten(0, 1), labels[:, pos].flatten()).backward()
        grads.append(w.grad.clone())
    torch.testing.assert_close(sum(grads) / cp, full, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- refusals, one line each


@pytest.mark.parametrize("kw, spec, match", [
    ({"seq_len": 32, "device_type": "cpu"}, TINY, "cp = 2: context parallel runs on GPUs only"),
    ({"seq_len": 30, "device_type": "cuda"}, TINY, "divisible by 2 x cp = 4 .* it is 30"),
    ({"seq_len": 32, "device_type": "cuda"},
     ModelSpec(name="gpt", n_layers=2, hidden=32, n_heads=4, ffn=64, vocab=128,
               positions="learned", max_positions=64), "rotary positions only"),
])
def test_check_layout_refuses_cp_it_cannot_run(kw, spec, match):
    with pytest.raises(LayoutError, match=match) as err:
        pz.check_layout(ParallelConfig(cp=2), spec, 2, **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cfg", [ParallelConfig(cp=2), ParallelConfig(dp=2, cp=2, zero=3),
                                 ParallelConfig(cp=2, tp=2), ParallelConfig(cp=2, pp=2,
                                                                             grad_accum=2)])
def test_check_layout_accepts_cp_on_gpu(cfg):
    pz.check_layout(cfg, TINY, cfg.world, seq_len=64, device_type="cuda")


def test_positions_refuse_bad_arguments():
    with pytest.raises(LayoutError, match="not divisible by 2 x cp = 4"):
        context.head_tail_positions(10, 2, 0)
    with pytest.raises(LayoutError, match="0 <= rank < cp"):
        context.head_tail_positions(8, 2, 2)


def test_harness_refuses_cp_on_cpu_in_one_line_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH",
                                                                               "")]))
    proc = subprocess.run([sys.executable, "-m", "trainplan.bench.harness.train", "--cpu",
                           "--cp", "2", "--model", "llama-1.3b", "--synthetic", "--steps", "2",
                           "--warmup", "1"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cp = 2: context parallel runs on GPUs only" in lines[0], lines


# ---------------------------------------------------------------- 4 gloo ranks


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", str(Path(__file__).with_name("cp_ranks.py")),
                           str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_cp_ranks_of_a_replica_read_the_same_data(four_ranks):
    """dp 2 x cp 2: ranks 0, 1 form one cp group (replica 0), ranks 2, 3 the other."""
    assert [r["cp_group"] for r in four_ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["cp_rank"] for r in four_ranks] == [0, 1, 0, 1]
    assert [r["dp"] for r in four_ranks] == [[0, 2], [0, 2], [1, 2], [1, 2]]


def test_fsdp_shards_over_dp_shard_times_cp(four_ranks):
    for r in four_ranks:
        assert r["fsdp"] and r["has_cp_mesh"]
        assert r["fsdp_mesh_dims"] == ["dp_shard_cp"] and r["fsdp_mesh_ranks"] == [0, 1, 2, 3]


def test_step_context_shards_the_buffers_in_head_tail_order(four_ranks):
    """Inside `shard_sequences` each cp rank holds its share of ids, labels and rotary
    tables in `head_tail_positions` order; after it the tables are whole again."""
    for r in four_ranks:
        assert r["ids_are_share"] and r["labels_are_share"] and r["rope_is_share"]
        assert r["rope_restored"] and r["batch_left_sharded"]


def test_checkpoint_of_a_cp_layout_loads_into_other_layouts(four_ranks):
    """The state of dp 2 x cp 2 (sharded 4 ways) is the single process's model, and its DCP
    checkpoint loads into dp 4 and into a fresh dp 2 x cp 2 with every tensor equal."""
    for r in four_ranks:
        assert r["cp_state_is_reference"]
        assert r["loads_into_dp4"] and r["loads_into_cp2_again"]
