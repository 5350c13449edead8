"""The CUDA caching allocator's two modes in the memory model (`memory_runtime.allocator_of`,
`fragmentation_bytes`, `root_reduce_bytes`, `memory.breakdown`)."""

import os

import pytest

from conftest import layouts
from trainplan.bench.harness.host import allocator_env
from trainplan.cost import memory
from trainplan.cost import memory_runtime as rt
from trainplan.specs import load_model

G8 = load_model("data/models/llama3-8b.yaml")
M = load_model("llama-1.3b")
BASE = dict(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, dp_shard=1, micro_batch=2, grad_accum=1)


@pytest.mark.parametrize("env, unset, mode", [
    (None, rt.CACHING, rt.CACHING),  # no environment recorded: an old record
    ({}, rt.CACHING, rt.CACHING),
    ({}, rt.EXPANDABLE, rt.EXPANDABLE),  # a process trainplan's harness will set up
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, rt.CACHING, rt.EXPANDABLE),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:True"},
     rt.CACHING, rt.EXPANDABLE),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, rt.EXPANDABLE, rt.CACHING),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, rt.EXPANDABLE, rt.CACHING),
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage"}, rt.EXPANDABLE, rt.CACHING),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, rt.EXPANDABLE, rt.CACHING),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, rt.CACHING, rt.EXPANDABLE),
    # the CUDA variable is read first where both are set
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True",
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, rt.EXPANDABLE, rt.CACHING),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true"}, rt.EXPANDABLE, rt.CACHING),
])
def test_allocator_of_reads_the_environment(env, unset, mode):
    assert rt.allocator_of(env, unset=unset) == mode


def test_allocator_env_sets_expandable_unless_the_user_chose():
    env = {}
    assert allocator_env(env) == rt.EXPANDABLE
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}
    assert allocator_env(mine) == rt.CACHING
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}  # kept as it was
    generic = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert allocator_env(generic) == rt.CACHING and "PYTORCH_CUDA_ALLOC_CONF" not in generic
    assert allocator_env(dict(os.environ)) in rt.ALLOCATORS


def test_expandable_segments_strand_nothing():
    acts = 10 * 2**30
    assert rt.fragmentation_bytes(acts, allocator=rt.EXPANDABLE) == 0.0
    assert rt.fragmentation_bytes(acts, allocator=rt.CACHING) == pytest.approx(
        rt.FRAGMENTATION * acts)
    head = rt.head_block_bytes(G8, seq_len=4096, micro_batch=2, cp=1, compiled_loss=True)
    kw = dict(path=rt.FSDP, tp=1, pp=1, ep=1, zero=2, dp_shard=4, cp=1, head_block=head)
    assert rt.root_reduce_bytes(G8, allocator=rt.CACHING, **kw) > 3 * 2**30
    assert rt.root_reduce_bytes(G8, allocator=rt.EXPANDABLE, **kw) == 0.0


@pytest.mark.parametrize("model, lay", [
    (G8, {"dp": 4, "dp_shard": 4, "zero": 2}),  # FSDP2: root segment and fragmentation
    (M, {"tp": 2}),  # autocast under TP: fragmentation only
    (M, {}),  # one GPU
])
def test_breakdown_differs_by_the_allocators_reserve_only(model, lay):
    L = layouts(**{**BASE, **lay})
    cach = memory.breakdown(model, L, seq_len=4096, compiled_loss=True, allocator=rt.CACHING)
    expd = memory.breakdown(model, L, seq_len=4096, compiled_loss=True,
                            allocator=rt.EXPANDABLE)
    for term in ("params", "grads", "optimizer", "activations"):
        assert expd[term].item() == cach[term].item()
    assert expd["other"].item() < cach["other"].item()
    assert expd["total"].item() < cach["total"].item()
    # the default is the mode trainplan's runs use
    dflt = memory.breakdown(model, L, seq_len=4096, compiled_loss=True)
    assert dflt["total"].item() == expd["total"].item()
