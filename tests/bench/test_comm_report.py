"""The collective report: on 2 CPU ranks a TP layout shows only TP collectives, in the
number sequence parallel implies, and an FSDP2 layout shows one all-gather per group
in each pass and one reduce-scatter, each of the whole model's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainplan.bench.harness.model import Transformer, count_params
from trainplan.bench.observe import comm_report
from trainplan.specs import load_model

LAYERS = 2
TINY = f"n_layers: {LAYERS}\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
BASE = ["--seq-len", "16", "--micro-batch", "2", "--steps", "3", "--warmup", "1",
        "--synthetic", "--cpu"]
LIB = Path(__file__).resolve().parents[2] / "lib"
KEYS = {"layout", "collectives_per_step", "totals_per_step", "comm_debug_counts_per_step",
        "dynamo", "counted_steps", "mesh_dims", "step_s_median"}


def test_kinds_and_sizes():
    assert comm_report.kind_of("_allgather_base_") == "all_gather"
    assert comm_report.kind_of("all_gather_into_tensor") == "all_gather"
    assert comm_report.kind_of("_reduce_scatter_base_") == "reduce_scatter"
    assert comm_report.kind_of("allreduce_") == "all_reduce"
    shard, full = torch.zeros(4, 8), torch.zeros(8, 8)
    # functional all-gather: (shard, group size, group name); S is the gathered tensor
    assert comm_report.collective_size("all_gather", "_c10d_functional.all_gather_into_tensor",
                                       (shard, 2, "0")) == (256, "float32")
    # c10d reduce-scatter: (output shard, input, group, ...); S is the input
    assert comm_report.collective_size("reduce_scatter", "c10d._reduce_scatter_base_",
                                       (shard, full, None)) == (256, "float32")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """The launches at once (each is mostly start-up): TP 2, FSDP2 zero 3 compiled, PP 2."""
    model = tmp_path_factory.mktemp("comm") / "tiny.yaml"
    model.write_text(TINY)
    layouts = {"tp": ["--tp", "2"],
               "fsdp": ["--dp", "2", "--zero", "3", "--compile", "--backend", "eager"],
               "pp": ["--pp", "2", "--grad-accum", "2"]}
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    procs = {}
    for tag, extra in layouts.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "trainplan.bench.observe.comm_report",
               "--model", str(model), *BASE, *extra]
        procs[tag] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    out = {}
    for tag, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-4000:]
        out[tag] = json.loads(next(x for x in stdout.splitlines() if x.startswith("{")))
    out["params"] = count_params(Transformer.from_spec(load_model(str(model)), max_seq_len=16))
    return out


@pytest.mark.slow
def test_tp_layout_shows_tp_collectives_only(reports):
    got = reports["tp"]
    assert KEYS <= set(got) and got["mesh_dims"] == ["tp"] and got["dynamo"] is None
    calls = {k: v["calls"] for k, v in got["collectives_per_step"].items()}
    assert all(" tp " in k for k in calls), calls
    # sequence parallel: per block 2 all-gathers and 2 reduce-scatters each pass; the
    # embedding's reduce-scatter, the final norm's and the logits' all-gathers forward
    assert calls["all_gather tp fwd"] == 2 * LAYERS + 2
    assert calls["reduce_scatter tp fwd"] == 2 * LAYERS + 1
    assert calls["all_gather tp bwd"] == calls["reduce_scatter tp bwd"] == 2 * LAYERS + 1
    # after the backward: the norms' Partial gradients made whole in one all-reduce
    # (step.reduce_partial_grads), then one for the squared norm of the TP-sharded
    # gradients (clip_grad_norm, on local shards); none in the optimizer, which would
    # otherwise reduce each norm's gradient per op
    assert calls["all_reduce tp step"] == 2
    assert not {k for k in calls if k.endswith(" step")} - {"all_reduce tp step"}, calls


@pytest.mark.slow
def test_fsdp_layout_gathers_and_reduces_the_model(reports):
    got, n = reports["fsdp"], reports["params"]
    assert KEYS <= set(got) and got["mesh_dims"] == ["dp_shard"]
    per = got["collectives_per_step"]
    assert not any(" tp " in k for k in per), per
    # zero 3: every block and the root all-gathered in forward and again in backward,
    # gradients reduce-scattered once; fp32 on CPU, so S = 4 bytes x parameters
    for key in ("all_gather dp_shard fwd", "all_gather dp_shard bwd",
                "reduce_scatter dp_shard bwd"):
        assert per[key]["calls"] == LAYERS + 1, key
        assert per[key]["bytes"] == 4 * n, key
    assert got["dynamo"]["graph_breaks"] == 0 and got["dynamo"]["block_graph_variants"] >= 1


@pytest.mark.slow
def test_pipeline_layout_is_counted(reports):
    """A pipeline stage's modules begin their forward outside the counted step (the module
    tracker raised there); its stage-to-stage sends are point-to-point, which CommDebugMode
    does not count, so the step's one all-reduce over the stages (the gradient norm) is all."""
    got = reports["pp"]
    assert got["mesh_dims"] == ["pp"] and got["counted_steps"] >= 1
    assert {k: v["calls"] for k, v in got["collectives_per_step"].items()} == \
        {"all_reduce pp step": 1.0}
