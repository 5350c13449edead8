"""fp8's cost terms (`cost.fp8`) and `trainplan plan --precision fp8`: each term by hand or
against bf16, the rule of which linears convert, and the refusal where a card has no fp8."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT, easy_cluster, layouts, tiny_model, trainplan_cli
from trainplan.calibrate.store import load_gpu
from trainplan.cost import comms, fp8, params
from trainplan.cost.compute import FULL, NONE
from trainplan.cost.step_time import evaluate
from trainplan.errors import SpecError
from trainplan.specs import load_cluster, load_model


@pytest.fixture(scope="module")
def h100():
    return load_gpu("h100-sxm", calibrated=False)


@pytest.mark.parametrize("recipe, out, inn, expected", [
    ("tensorwise", 2048, 2048, True), ("tensorwise", 1024, 4096, False),
    ("tensorwise", 1024, 8192, True), ("tensorwise", 2056, 2048, False),  # 2056 % 16 = 8
    ("rowwise", 2048, 5504, False), ("rowwise", 5504, 2048, True),
    ("rowwise", 4096, 2048, False), ("rowwise", 4096, 4096, True), ("rowwise", 8192, 1024, False),
])
def test_converts_rule(recipe, out, inn, expected):
    assert fp8.converts(out, inn, recipe) is expected


def test_converted_params_of_the_proxy():
    m = load_model("llama-1.3b")  # h 2048, f 5504: tensorwise takes all, rowwise gate and up
    every = params.attention_params(m) + params.expert_params(m)  # no biases in the preset
    assert fp8.converted_layer_params(m, "tensorwise") == every
    assert fp8.converted_layer_params(m, "rowwise") == 2 * 2048 * 5504
    assert fp8.converted_layer_params(m, "tensorwise", tp=2) == every / 2
    assert fp8.converted_layer_params(tiny_model(), "tensorwise") == 0  # h 64: nothing pays


def test_cast_bytes_by_hand():
    m, t = load_model("llama-1.3b"), 4096.0
    h, f = 2048, 5504  # rowwise: only w1 and w3 (n = f, k = h), 2 GEMMs a token, 2 weights
    act = 2 * (t * h * 2 + 2 * t * f)
    weight = 2 * f * h * 2
    got = fp8.cast_bytes(m, recipe="rowwise", tokens=t, tp=1, recompute=NONE, fp8_gather=False,
                         layers=1)
    assert got == pytest.approx(fp8.CAST_BYTES * (act + weight))
    again = fp8.cast_bytes(m, recipe="rowwise", tokens=t, tp=1, recompute=FULL,
                           fp8_gather=False, layers=3)
    assert again == pytest.approx(3 * fp8.CAST_BYTES * (act + 2 * t * h + weight + 2 * f * h))
    gathered = fp8.cast_bytes(m, recipe="rowwise", tokens=t, tp=1, recompute=NONE,
                              fp8_gather=True, layers=1)
    assert gathered == pytest.approx(fp8.CAST_BYTES * act)  # the weights arrive in fp8


def _step(model, gpu, precision, recipe="tensorwise", seq=4096, **lay):
    cluster = load_cluster("dgx-h100")
    return evaluate(load_model(model) if isinstance(model, str) else model, gpu, cluster,
                    layouts(**lay), seq, precision=precision, fp8_recipe=recipe).iloc[0]


def test_fp8_faster_for_a_matmul_bound_model(h100):
    lay = dict(dp=8, zero=3, micro_batch=2)
    bf16, tw, rw = (_step("llama-13b", h100, p, r, **lay) for p, r in
                    (("bf16", "tensorwise"), ("fp8", "tensorwise"), ("fp8", "rowwise")))
    assert tw.step_time_s < 0.85 * bf16.step_time_s
    assert tw.step_time_s < rw.step_time_s < bf16.step_time_s  # rowwise: slower GEMMs, bf16 AG
    assert tw.mfu / bf16.mfu == pytest.approx(bf16.step_time_s / tw.step_time_s)  # bf16 peak
    assert tw.family == "FSDP fp8" and bf16.family == "FSDP"
    assert rw.family == "FSDP fp8 rowwise"  # trusted on rowwise records alone


def test_records_name_the_family_the_planner_names():
    """`compare.trust.family_of` (a record's or plan's layout) agrees with the planner's
    table on bf16, fp8 tensorwise and fp8 rowwise: each band joins the plans it is for."""
    from trainplan.compare.trust import family_of
    lay = dict(tp=1, pp=1, cp=1, ep=1, zero=3, dp=8)
    assert family_of(lay) == "FSDP"
    assert family_of({**lay, "precision": "fp8", "fp8_recipe": "tensorwise"}) == "FSDP fp8"
    assert family_of({**lay, "precision": "fp8"}) == "FSDP fp8"  # tensorwise, the default
    assert family_of({**lay, "precision": "fp8", "fp8_recipe": "rowwise"}) == "FSDP fp8 rowwise"
    assert family_of({**lay, "precision": "bf16", "fp8_recipe": "rowwise"}) == "FSDP"


def test_fp8_no_faster_for_a_tiny_model(h100):
    tiny = tiny_model(hidden=256, n_heads=4, ffn=512, vocab=1000)  # nothing converts
    bf16 = _step(tiny, h100, "bf16", seq=512, dp=4, zero=2, micro_batch=4)
    low = _step(tiny, h100, "fp8", seq=512, dp=4, zero=2, micro_batch=4)
    assert low.step_time_s >= bf16.step_time_s
    assert low.total_gib >= bf16.total_gib


def test_fp8_all_gather_moves_half_the_converted_bytes(h100):
    p = 1e9
    assert fp8.gather_params(p, p, True) == p / 2
    assert fp8.gather_params(p, 0.4 * p, True) == pytest.approx(0.8 * p)
    assert fp8.gather_params(p, p, False) == p
    cluster = easy_cluster()
    kw = dict(cluster=cluster, stage_params=p, zero=3, dp_shard=4, cp=1, tp=1)
    fixed = comms.dp_microbatch_time(**kw, gather_params=0.0)  # reduce-scatter, latencies
    bf16_ag = comms.dp_microbatch_time(**kw) - fixed
    fp8_ag = comms.dp_microbatch_time(**kw, gather_params=fp8.gather_params(p, p, True)) - fixed
    assert bf16_ag > 0 and fp8_ag == pytest.approx(bf16_ag / 2)  # ZeRO-3's two gathers
    lay = dict(dp=8, zero=3, micro_batch=2)
    bf16, tw, rw = (_step("llama-13b", h100, pr, r, **lay) for pr, r in
                    (("bf16", "tensorwise"), ("fp8", "tensorwise"), ("fp8", "rowwise")))
    assert rw.dp_comm_s == pytest.approx(bf16.dp_comm_s)  # rowwise gathers bf16
    assert tw.dp_comm_s < bf16.dp_comm_s


def test_memory_of_fp8_weights_and_scales():
    m = load_model("llama-1.3b")
    stage = fp8.converted_layer_params(m, "tensorwise") * m.n_layers
    kw = dict(recipe="tensorwise", tokens=8192.0, tp=1, pp=1, ep=1, fsdp=True)
    p2, o2 = fp8.memory_delta(m, zero=2, fp8_gather=True, **kw)
    p3, o3 = fp8.memory_delta(m, zero=3, fp8_gather=True, **kw)
    assert p2 == -stage and p3 == 0  # ZeRO-2 keeps the unsharded fp8 weights: 1 B less each
    block = stage / m.n_layers
    assert o3 - o2 == pytest.approx(-2 * block)  # ZeRO-3: two gathered blocks in fp8
    t, h, f = 8192.0, 2048, 5504  # the largest copies: the down projection's backward
    assert o2 == pytest.approx(max(t * k + 2 * t * n + n * k for n, k in
                                   ((h, h), (f, h), (h, f))) + 16)
    p_rw, _ = fp8.memory_delta(m, zero=2, fp8_gather=False, **{**kw, "recipe": "rowwise"})
    assert p_rw == 0


def test_fp8_refused_without_an_fp8_rate():
    with pytest.raises(SpecError, match="a100-80gb has no fp8"):
        fp8.check_gpu(load_gpu("a100-80gb"))
    out = trainplan_cli(["plan", "--model", "llama-7b", "--gpu", "a100-80gb", "--gpus", "8",
                         "--precision", "fp8", "--json"], ROOT)
    assert out.returncode == 2 and out.stdout == ""
    lines = [ln for ln in out.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and "--precision fp8" in lines[0] and "Traceback" not in out.stderr


def test_plan_json_says_fp8_and_not_validated():
    base = ["plan", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--gpus", "8", "--top", "3",
            "--json"]
    low = json.loads(trainplan_cli(base + ["--precision", "fp8"], ROOT).stdout)
    high = json.loads(trainplan_cli(base, ROOT).stdout)
    assert low["precision"] == "fp8" and "precision" not in high  # bf16: the default
    assert low["fp8"]["recipe"] == "tensorwise" and low["fp8"]["validated"] is False
    assert set(low["fp8"]["converted"]) == {"wq", "wk wv", "wo", "w1 w3", "w2"}
    # each fp8 plan is judged by its own fp8 family's records: ZeRO-1 has none in fp8
    assert all(p["validation"]["family"].endswith(" fp8") for p in low["plans"])
    zero1 = [p["validation"] for p in low["plans"] if p["strategy"] == "ZeRO-1"]
    assert zero1 and not any(v["validated"] for v in zero1)
    assert low["plans"][0]["tokens_per_s_per_gpu"] > high["plans"][0]["tokens_per_s_per_gpu"]
    tp = json.loads(trainplan_cli(base + ["--precision", "fp8", "--tp", "2", "--dp", "4",
                                          "--zero", "3", "--micro-batch", "2",
                                          "--recompute", "none"], ROOT).stdout)
    assert tp["plans"][0]["runnable"] is False and "tensor parallel" in \
        tp["plans"][0]["not_runnable_why"]


def test_fp8_fraction_from_curve_or_preset(h100):
    assert fp8.fp8_efficiency_at(h100, "tensorwise", 4096, 1e7) == h100.fp8_matmul_efficiency
    assert fp8.fp8_efficiency_at(h100, "rowwise", 4096, 1e7) == pytest.approx(
        h100.fp8_matmul_efficiency * fp8.ROWWISE_PRESET_FACTOR)
    import dataclasses

    measured = dataclasses.replace(h100, fp8_matmul_curve=((4096.0, 1e6, 0.3),
                                                           (4096.0, 1e8, 0.7)))
    assert fp8.fp8_efficiency_at(measured, "tensorwise", 4096, 1e7) == pytest.approx(0.5)
    assert np.isclose(fp8.summary(load_model("llama-1.3b"), measured, "tensorwise")["validated"],
                      True)


def test_a_recipes_measured_cast_scale_prices_its_casts_alone(h100):
    """`fp8_rowwise_cast_scale` lengthens a rowwise step's compute by its casts' extra time
    (the step by no more: longer compute may hide more of FSDP's traffic) and leaves
    tensorwise and bf16 steps as they were."""
    import dataclasses
    lay = dict(dp=8, zero=3, micro_batch=2)
    slow = dataclasses.replace(h100, fp8_rowwise_cast_scale=3.0)
    m = load_model("llama-13b")
    casts = fp8.cast_time(h100, fp8.cast_bytes(m, recipe="rowwise", tokens=2 * 4096, tp=1,
                                               recompute=NONE, fp8_gather=False,
                                               layers=m.n_layers))
    rw, rw_slow = (_step("llama-13b", g, "fp8", "rowwise", **lay) for g in (h100, slow))
    assert rw_slow.compute_s - rw.compute_s == pytest.approx(2.0 * casts, rel=1e-6)
    assert 0 < rw_slow.step_time_s - rw.step_time_s <= 2.0 * casts * (1 + 1e-9)
    for precision in ("bf16", "fp8"):
        assert _step("llama-13b", slow, precision, **lay).step_time_s == \
            _step("llama-13b", h100, precision, **lay).step_time_s


def test_a_measured_kept_ratio_shrinks_fp8_activations_only(h100):
    """`fp8_activation_ratio` scales what an fp8 block keeps for backward, bf16 weight casts
    aside: a one-GPU (autocast) plan also drops its converted weights' bf16 casts; bf16
    plans and the other recipe keep their bytes."""
    import dataclasses

    from trainplan.cost import memory_runtime as rt
    lean = dataclasses.replace(h100, fp8_activation_ratio=0.5)
    m = load_model("llama-13b")
    for lay in (dict(dp=8, zero=3, micro_batch=2), dict(dp=1, zero=0, micro_batch=2)):
        base, half = (_step(m, g, "fp8", **lay) for g in (h100, lean))
        assert half.activations_gib < base.activations_gib
        for precision, recipe in (("bf16", "tensorwise"), ("fp8", "rowwise")):
            assert _step(m, lean, precision, recipe, **lay).activations_gib == \
                _step(m, h100, precision, recipe, **lay).activations_gib
    # measured without recompute only: a recomputing fp8 plan keeps bf16's ratio
    full = dict(dp=8, zero=3, micro_batch=2, recompute=FULL)
    assert _step(m, lean, "fp8", **full).activations_gib == \
        _step(m, h100, "fp8", **full).activations_gib
    # one block's kept bytes on the autocast path, by hand: the ratio on all but the weight
    # casts, which fp8 keeps only for the linears it leaves in bf16 (none at 13B)
    kw = dict(seq_len=4096, micro_batch=1, tp=1, cp=1, recompute=NONE, sequence_parallel=False,
              path=rt.AUTOCAST)
    from trainplan.cost import memory
    bf16 = memory.layer_kept_bytes(m, **kw)
    copies = rt.weight_copy_bytes(m, path=rt.AUTOCAST, tp=1, ep=1, recompute=NONE)
    share = fp8.converted_share(m, "tensorwise")
    assert share == pytest.approx(1.0, abs=1e-4)
    assert memory.layer_kept_bytes(m, fp8_kept=(0.5, share), **kw) == pytest.approx(
        0.5 * (bf16 - copies) + (1 - share) * copies)
