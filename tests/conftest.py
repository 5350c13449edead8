"""Shared fixtures: tiny made-up specs whose numbers are easy to work out by hand.

The tiny model (4 layers, hidden 64, 4 heads of 16, FFN 128, vocab 100,
Llama-style: SwiGLU, RoPE, RMSNorm, untied) has, worked out once here:

    attention  h (h + 2 h_kv) + h h = 64 * (64 + 128) + 64 * 64 = 16,384
    SwiGLU MLP 3 h f                = 3 * 64 * 128             = 24,576
    two norms  2 h                  = 128
    one block                       = 41,088
    input table V h                 = 6,400
    output V h + final norm h       = 6,464
    total 6,400 + 4 * 41,088 + 6,464 = 177,216
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan.specs import ClusterSpec, GPUSpec, ModelSpec

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(**overrides) -> ModelSpec:
    kw = dict(name="tiny", n_layers=4, hidden=64, n_heads=4, ffn=128, vocab=100)
    kw.update(overrides)
    return ModelSpec(**kw)


def easy_gpu(**overrides) -> GPUSpec:
    """100 TFLOP/s peak, 1 TB/s HBM; matmul at 50%, attention at 25%, memory at 50%."""
    kw = dict(name="easy", bf16_tflops=100.0, memory_gib=10.0, hbm_tbps=1.0,
              matmul_efficiency=0.5, attention_efficiency=0.25, memory_efficiency=0.5)
    kw.update(overrides)
    return GPUSpec(**kw)


def easy_cluster(**overrides) -> ClusterSpec:
    """4 GPUs a node; 100 GB/s inside at 50%, 10 GB/s across at 50%; 10 us / 20 us latency."""
    kw = dict(name="easy", gpus_per_node=4, intra_node_gbps=100.0, inter_node_gbps=10.0,
              intra_node_latency_us=10.0, inter_node_latency_us=20.0,
              intra_node_efficiency=0.5, inter_node_efficiency=0.5)
    kw.update(overrides)
    return ClusterSpec(**kw)


def free_cluster() -> ClusterSpec:
    """Communication costs (almost) nothing: no latency, absurd bandwidth."""
    return easy_cluster(intra_node_gbps=1e15, inter_node_gbps=1e15, intra_node_latency_us=0.0,
                        inter_node_latency_us=0.0, intra_node_efficiency=1.0,
                        inter_node_efficiency=1.0)


@pytest.fixture
def tiny() -> ModelSpec:
    return tiny_model()


@pytest.fixture
def gpu() -> GPUSpec:
    return easy_gpu()


@pytest.fixture
def cluster() -> ClusterSpec:
    return easy_cluster()


def trainplan_cli(args, cwd, timeout=60) -> subprocess.CompletedProcess:
    """Run `python -m trainplan.cli ARGS` in `cwd`, as a user would, capturing both streams."""
    env = dict(os.environ, PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, "-m", "trainplan.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def layouts(**columns):
    """`Layouts` of the given columns (numbers or arrays), the others at ParallelConfig's
    defaults; `dp_shard` defaults to dp where zero >= 1, else 1."""
    import numpy as np

    from trainplan.specs.layouts import Layouts

    cols = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "micro_batch": 1,
            "grad_accum": 1, "recompute": 0, "sequence_parallel": True, "pp_schedule": 0,
            "pp_virtual": 1, **columns}
    if "dp_shard" not in cols:
        cols["dp_shard"] = np.where(np.asarray(cols["zero"]) > 0, cols["dp"], 1)
    return Layouts.from_columns(**cols)
