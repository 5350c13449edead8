"""Strategy search: enumeration rules, ranking, refusals, and the plan/memory answers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import easy_cluster, easy_gpu, tiny_model
from trainplan.calibrate.store import load_gpu
from trainplan.errors import LayoutError, NoFeasiblePlan
from trainplan.plan import planner as planmod
from trainplan.plan.search import (
    best_per_strategy,
    check_cluster_size,
    divisors,
    enumerate_layouts,
    rank,
    search,
)
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import RECOMPUTE, SCHEDULES, Layouts

M13 = dict(gpus=32, seq_len=4096, global_batch_tokens=4 * 2**20)


@pytest.fixture(scope="module")
def specs13():
    return load_model("llama-13b"), load_gpu("h100-sxm"), load_cluster("dgx-h100")


@pytest.fixture(scope="module")
def result13(specs13):
    m, gpu, cl = specs13
    return search(m, gpu, cl, **M13)


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(32) == [1, 2, 4, 8, 16, 32]


def test_check_cluster_size():
    check_cluster_size(32, 8)
    check_cluster_size(4, 8)  # one partial node
    with pytest.raises(LayoutError, match="--gpus 12 is not a multiple of --gpus-per-node 8"):
        check_cluster_size(12, 8)
    with pytest.raises(LayoutError, match="--gpus 0"):
        check_cluster_size(0, 8)


def _assert_valid(L: Layouts, m, gpus, gpn, seq_len, gbt):
    """Every rule the search promises, row by row (vectorised)."""
    assert len(L) > 0
    assert np.all(L.dp * L.tp * L.pp * L.cp == gpus)
    assert np.all(L.dp * L.micro_batch * L.grad_accum * seq_len == gbt)
    assert np.all(gpn % L.tp == 0) and np.all(L.tp <= gpn)
    assert np.all(m.n_heads % L.tp == 0) and np.all(m.n_kv_heads % L.tp == 0)
    assert np.all(m.ffn % L.tp == 0)
    assert np.all(m.n_layers % (L.pp * L.pp_virtual) == 0)
    assert np.all((L.cp == 1) | (seq_len % (2 * L.cp) == 0))
    assert np.all((m.n_experts % L.ep == 0) & ((L.dp * L.cp) % L.ep == 0))
    assert np.all(L.dp % L.dp_shard == 0)
    assert np.all((L.zero > 0) | (L.dp_shard == 1))
    assert np.all((L.pp_virtual == 1) | (L.pp_schedule == SCHEDULES.index("interleaved")))
    one_f_one_b = (L.pp > 1) & (L.pp_schedule != SCHEDULES.index("gpipe"))
    assert np.all(~one_f_one_b | (L.grad_accum >= L.pp))
    assert set(np.unique(L.zero)) <= {0, 1, 2, 3}
    assert set(np.unique(L.recompute)) <= set(range(len(RECOMPUTE)))


def test_enumerate_llama_13b_on_32_gpus_all_valid(specs13):
    m = specs13[0]
    L = enumerate_layouts(m, gpus=32, gpus_per_node=8, seq_len=4096,
                          global_batch_tokens=4 * 2**20)
    _assert_valid(L, m, 32, 8, 4096, 4 * 2**20)
    rows = {tuple(r) for r in np.stack([L.dp, L.tp, L.pp, L.cp], axis=1).tolist()}
    assert (32, 1, 1, 1) in rows and (4, 8, 1, 1) in rows and (1, 8, 4, 1) in rows
    assert not any(tp == 16 for _, tp, _, _ in rows)  # tp stays inside a node
    assert not any(40 % pp for _, _, pp, _ in rows)
    # every row is a valid ParallelConfig
    for i in range(0, len(L), max(1, len(L) // 200)):
        assert L.config(i).world == 32


def test_enumerate_moe_includes_expert_parallel():
    m = load_model("mixtral-8x7b")
    L = enumerate_layouts(m, gpus=16, gpus_per_node=8, seq_len=4096,
                          global_batch_tokens=2**20)
    _assert_valid(L, m, 16, 8, 4096, 2**20)
    assert set(np.unique(L.ep)) == {1, 2, 4, 8}


def test_enumerate_gqa_limits_tp_to_kv_heads():
    m = tiny_model(n_heads=8, n_kv_heads=2, hidden=64)
    L = enumerate_layouts(m, gpus=8, gpus_per_node=8, seq_len=64, global_batch_tokens=64 * 16)
    assert set(np.unique(L.tp)) == {1, 2}


def test_enumerate_hsdp_only_for_zero3():
    m = tiny_model()
    L = enumerate_layouts(m, gpus=16, gpus_per_node=4, seq_len=64, global_batch_tokens=64 * 32)
    hsdp = (L.zero > 0) & (L.dp_shard < L.dp)
    assert hsdp.any()
    assert np.all(L.zero[hsdp] == 3)  # ZeRO-1/2 shard over all of dp
    assert np.all(L.dp_shard[L.zero == 0] == 1)
    # the HSDP shard group is one node's worth of data-parallel ranks
    assert np.all(L.dp_shard[hsdp] * L.tp[hsdp] * L.cp[hsdp] == 4)


def test_enumerate_pins_restrict_every_row():
    m = tiny_model(n_layers=8)
    pins = dict(tp=2, pp=2, cp=1, zero=1, recompute="selective", micro_batch=2)
    L = enumerate_layouts(m, gpus=8, gpus_per_node=4, seq_len=64, global_batch_tokens=64 * 32,
                          pins=pins)
    assert np.all(L.tp == 2) and np.all(L.pp == 2) and np.all(L.zero == 1)
    assert np.all(L.recompute == RECOMPUTE.index("selective")) and np.all(L.micro_batch == 2)
    assert np.all(L.dp == 2) and np.all(L.grad_accum == 8)


@pytest.mark.parametrize(("pins", "fragment"), [
    (dict(tp=3), "--tp 3 is not valid"),
    (dict(tp=8), "--tp 8 is not valid"),  # more than a node of 4
    (dict(pp=3), "--pp 3 is not valid"),
    (dict(cp=16), "--cp 16 is not valid"),
    (dict(dp=3), "--dp 3 is not valid"),
    (dict(ep=2), "--ep 2 is not valid"),  # dense model
])
def test_enumerate_refuses_impossible_pins(pins, fragment):
    m = tiny_model()  # 4 layers, 4 heads
    with pytest.raises(LayoutError, match=fragment):
        enumerate_layouts(m, gpus=8, gpus_per_node=4, seq_len=16, global_batch_tokens=16 * 64,
                          pins=pins)


@pytest.mark.parametrize(("pins", "fragment"), [
    (dict(tp=4, pp=4), "the pins --tp 4 x --pp 4 need 16 GPUs, and 16 does not divide --gpus 8"),
    (dict(dp=4, tp=4), "the pins --dp 4 x --tp 4 need 16 GPUs"),
    (dict(dp=1, tp=2, pp=2, cp=1), "--dp 1 x --tp 2 x --pp 2 x --cp 1 use 4 GPUs, not --gpus 8"),
])
def test_enumerate_pins_that_cannot_share_the_gpus_say_so(pins, fragment):
    """Each pin valid on its own, their product not: the pins are named, not the batch."""
    with pytest.raises(LayoutError, match=fragment) as err:
        enumerate_layouts(tiny_model(), gpus=8, gpus_per_node=4, seq_len=16,
                          global_batch_tokens=16 * 64, pins=pins)
    assert "global batch" not in str(err.value)


def test_a_sequence_longer_than_learned_positions_is_refused():
    m = load_model("gpt2-xl")  # learned positions, max_positions 1024
    words = r"--seq-len 8192 is longer than model 'gpt2-xl' has learned positions for \(max_"
    with pytest.raises(LayoutError, match=words):
        enumerate_layouts(m, gpus=8, gpus_per_node=8, seq_len=8192, global_batch_tokens=8192 * 64)
    assert len(enumerate_layouts(m, gpus=8, gpus_per_node=8, seq_len=1024,
                                 global_batch_tokens=1024 * 64)) > 0


def test_enumerate_refuses_partial_sequences():
    with pytest.raises(LayoutError, match="not a multiple of --seq-len 64"):
        enumerate_layouts(tiny_model(), gpus=8, gpus_per_node=4, seq_len=64,
                          global_batch_tokens=100)


def test_enumerate_refuses_unreachable_batch():
    # 8 GPUs, 1 sequence a step, no context or pipeline parallel: dp x tp = 8 needs dp >= 2
    with pytest.raises(LayoutError, match="no layout reaches a global batch of 1 sequences"):
        enumerate_layouts(tiny_model(), gpus=8, gpus_per_node=4, seq_len=64,
                          global_batch_tokens=64, pins=dict(cp=1, pp=1))


def test_enumerate_pinned_dp_shard_is_validated():
    m = tiny_model()
    with pytest.raises(LayoutError, match="dp-shard"):
        L = enumerate_layouts(m, gpus=8, gpus_per_node=4, seq_len=64,
                              global_batch_tokens=64 * 32, pins=dict(dp_shard=3))
        _assert_valid(L, m, 8, 4, 64, 64 * 32)


def test_enumerate_bad_pp_virtual_names_the_flag(specs13):
    with pytest.raises(LayoutError, match="--pp-virtual 3"):
        enumerate_layouts(specs13[0], gpus=32, gpus_per_node=8, seq_len=4096,
                          global_batch_tokens=4 * 2**20, pins=dict(pp_virtual=3))


def test_enumerate_any_virtual_count_dividing_the_stage_is_a_valid_pin(specs13):
    """Megatron runs 96 layers as PP 8 x 3 virtual stages: not one of the searched (2, 4)."""
    m = dataclasses.replace(specs13[0], n_layers=96)
    L = enumerate_layouts(m, gpus=64, gpus_per_node=8, seq_len=4096,
                          global_batch_tokens=4 * 2**20,
                          pins=dict(pp=8, pp_virtual=3, pp_schedule="interleaved"))
    assert len(L) > 0
    assert np.all(L.pp_virtual == 3) and np.all(L.pp == 8)
    with pytest.raises(LayoutError, match="--pp-virtual 5 is not valid"):
        enumerate_layouts(m, gpus=64, gpus_per_node=8, seq_len=4096,
                          global_batch_tokens=4 * 2**20, pins=dict(pp=8, pp_virtual=5))


# ---------------------------------------------------------------- search and rank


def test_search_13b_ranks_fitting_plans_by_tokens_per_s(result13):
    t = result13.table
    assert result13.searched == len(t) > 1000
    assert result13.elapsed_s > 0
    fits = t["fits"].to_numpy()
    assert fits[0] and not np.any(np.diff(fits.astype(int)) > 0)  # fitting rows first
    tps = t.loc[t["fits"], "tokens_per_s"].to_numpy()
    assert np.all(np.diff(tps) <= 1e-6 * tps[:-1])


def test_search_best_returns_only_fitting_rows(result13):
    best = result13.best(10)
    assert len(best) == 10 and best["fits"].all()
    assert best.iloc[0]["tokens_per_s"] == result13.table["tokens_per_s"][
        result13.table["fits"]].max()


def test_search_13b_best_is_sensible(result13):
    b = result13.best(1).iloc[0]
    assert b["dp"] * b["tp"] * b["pp"] * b["cp"] == 32
    assert b["total_gib"] <= 79.6 - 2.0
    assert 0.3 < b["mfu"] < 0.8


def test_rank_breaks_exact_ties_by_simplicity_then_memory():
    import pandas as pd
    t = pd.DataFrame(dict(tp=[2, 1, 1, 1], pp=[1, 1, 1, 1], cp=[1, 2, 1, 1], ep=[1, 1, 1, 1],
                          fits=[True, True, True, False], tokens_per_s=[10.0, 10.0, 10.0, 99.0],
                          total_gib=[1.0, 1.0, 5.0, 1.0]))
    order = rank(t)
    assert list(order["fits"]) == [True, True, True, False]
    assert order.iloc[0]["total_gib"] == 5.0  # no model-parallel dimension wins the tie


def test_nothing_fits_is_refused():
    m, gpu, cl = load_model("llama-70b"), load_gpu("h100-sxm"), load_cluster("dgx-h100")
    with pytest.raises(NoFeasiblePlan, match="nothing fits: llama-70b on 1 x h100-sxm"):
        search(m, gpu, cl, gpus=1, seq_len=4096, global_batch_tokens=4 * 2**20)
    r = search(m, gpu, cl, gpus=1, seq_len=4096, global_batch_tokens=4 * 2**20,
               require_fit=False)
    assert not r.table["fits"].any() and r.best(5).empty


def test_gpus_per_node_override_changes_the_node(specs13):
    m, gpu, cl = specs13
    r = search(m, gpu, cl, gpus=8, seq_len=4096, global_batch_tokens=2**20, gpus_per_node=4)
    assert r.table["tp"].max() <= 4


def test_best_per_strategy_one_row_per_family(result13):
    b = best_per_strategy(result13.table)
    assert b["fits"].all()
    assert b["family"].is_unique and len(b) >= 3


# ---------------------------------------------------------------- plan and memory


def test_plan_contract_shape(specs13):
    out = planmod.plan(*specs13, top=3, **M13)
    assert len(out["plans"]) == 3
    assert isinstance(out["searched"], int) and isinstance(out["elapsed_s"], float)
    for p in out["plans"]:
        assert p["fits"] is True
        assert set(p["memory_gib"]) == {"params", "grads", "optimizer", "activations", "other",
                                         "total"}
        assert {"dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum",
                "recompute"} <= set(p["parallel"])
        assert p["tokens_per_s"] == pytest.approx(p["tokens_per_s_per_gpu"] * 32)
    speeds = [p["tokens_per_s"] for p in out["plans"]]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(speeds, speeds[1:], strict=False))


def test_plan_fully_pinned_returns_that_layout_even_if_it_does_not_fit():
    m, gpu, cl = load_model("llama-70b"), load_gpu("h100-sxm"), load_cluster("dgx-h100")
    pins = dict(dp=8, tp=1, pp=1, cp=1, zero=0, micro_batch=1, recompute="none")
    out = planmod.plan(m, gpu, cl, gpus=8, seq_len=4096, global_batch_tokens=2**20, pins=pins)
    assert len(out["plans"]) == 1
    p = out["plans"][0]
    assert p["fits"] is False and p["memory_gib"]["total"] > 1000  # 16 B x 69 G params
    assert {k: p["parallel"][k] for k in pins} == pins
    assert p["parallel"]["grad_accum"] == 2**20 // 4096 // 8


def test_plan_partly_pinned_honours_pins(specs13):
    out = planmod.plan(*specs13, pins=dict(tp=8, zero=1), top=5, **M13)
    assert all(p["parallel"]["tp"] == 8 and p["parallel"]["zero"] == 1 for p in out["plans"])


def test_memory_answer_matches_hand_count(specs13):
    m, gpu, cl = specs13
    out = planmod.memory(m, gpu, cl, ParallelConfig(tp=8), 4096)
    stage = (40 * ((13_015_864_320 - 2 * 32000 * 5120 - 5120) / 40 - 2 * 5120) / 8
             + 40 * 2 * 5120 + 2 * 32000 * 5120 / 8 + 5120 / 8)
    # TP alone (one data-parallel rank) runs under autocast: fp32 weights are the master
    # copy (4 bytes a parameter), Adam's two fp32 moments 8 (trainplan.cost.memory_runtime)
    assert out["memory_gib"]["params"] == pytest.approx(4 * stage / 2**30, abs=1e-3)
    assert out["memory_gib"]["optimizer"] == pytest.approx(8 * stage / 2**30, abs=1e-3)
    assert out["fits"] is True


def test_plan_with_a_tiny_model_on_an_easy_cluster():
    m, gpu, cl = tiny_model(n_layers=8), easy_gpu(), easy_cluster()
    out = planmod.plan(m, gpu, cl, gpus=8, seq_len=64, global_batch_tokens=64 * 64, top=4)
    assert 1 <= len(out["plans"]) <= 4 and all(p["fits"] for p in out["plans"])
    for p in out["plans"]:
        par = p["parallel"]
        assert par["dp"] * par["tp"] * par["pp"] * par["cp"] == 8
        assert par["dp"] * par["micro_batch"] * par["grad_accum"] * 64 == 64 * 64


def test_plan_never_returns_non_fitting_plans_when_top_is_large():
    m, gpu, cl = tiny_model(n_layers=8), easy_gpu(memory_gib=2.003), easy_cluster()  # 3 MiB free
    out = planmod.plan(m, gpu, cl, gpus=8, seq_len=64, global_batch_tokens=64 * 64, top=100_000)
    r = search(m, gpu, cl, gpus=8, seq_len=64, global_batch_tokens=64 * 64)
    assert 0 < int(r.table["fits"].sum()) < len(r.table)  # some fit, some do not
    assert all(p["fits"] for p in out["plans"])
