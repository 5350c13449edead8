"""Scales from the model-piece microbenchmarks: arithmetic on made-up records, then a real run."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from tests.bench.micro_runs import run_micro

from trainplan.calibrate import fit as calibrate
from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate import store as calibration
from trainplan.calibrate.store import load_gpu
from trainplan.cost import compute
from trainplan.cost.step_time import evaluate
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import Layouts

ROOT = Path(__file__).resolve().parents[2]
M = load_model("llama-1.3b")


def _gpu():
    return load_gpu("h100-sxm", calibrated=False)


def _block(seconds, kept, *, compile=True, recompute="none", mb=2, seq=2048):
    return {"config": {"model": M.name, "model_spec": dataclasses.asdict(M), "tokens": mb * seq,
                       "seq": seq, "micro_batch": mb, "compile": compile, "recompute": recompute},
            "results": {"time_s": seconds, "activation_bytes": kept}}


def _analytic_block(gpu):
    """The analytic terms (seconds) and kept bytes of one mb 2 x 2048 block of M."""
    t = calibrate_pieces.block_terms(M, gpu, tokens=4096, seq=2048, recompute="none")
    kept = float(calibrate_pieces.memory.layer_activation_bytes(
        M, seq_len=2048, micro_batch=2, tp=1, cp=1, recompute=0, sequence_parallel=False))
    return t, kept


def test_block_scale_recovers_a_known_elementwise_factor():
    gpu = _gpu()
    t, kept = _analytic_block(gpu)
    meas_c = t["matmul"] + t["attention"] + 1.7 * t["elementwise"]
    meas_e = t["matmul"] + t["attention"] + 4.0 * t["elementwise"]
    scales, checks = calibrate_pieces.fit(
        {"block": [_block(meas_c, 0.8 * kept), _block(meas_e, 1.3 * kept, compile=False)]}, gpu)
    assert scales["elementwise_scale"] == pytest.approx(1.7, rel=1e-3)
    assert scales["eager_elementwise_scale"] == pytest.approx(4.0, rel=1e-3)
    assert scales["activation_scales"] == [[False, "none", 1.3], [True, "none", 0.8]]
    for row in checks:  # with the scales applied, each block predicts itself
        assert row["predicted_s"] == pytest.approx(row["measured_s"], rel=1e-3)
        assert row["predicted_mib"] == pytest.approx(row["measured_mib"], rel=1e-3)


def test_scales_reach_the_cost_model():
    gpu = _gpu()
    L = Layouts.from_configs([ParallelConfig(dp=2, zero=2, micro_batch=8)])
    base = evaluate(M, gpu, load_cluster("dgx-h100"), L, 2048).iloc[0]
    scaled_gpu = calibrate_pieces.apply(gpu, {
        "eager_elementwise_scale": 3.0, "optimizer_scale": 2.0, "overlap_exposed": 0.5,
        "activation_scales": [[True, "none", 0.5], [False, "none", 1.0]]})
    compiled = evaluate(M, scaled_gpu, load_cluster("dgx-h100"), L, 2048).iloc[0]
    eager = evaluate(M, scaled_gpu, load_cluster("dgx-h100"), L, 2048, compiled=False).iloc[0]
    # the block scale halves the blocks, not the head: a compiled loss keeps 4 B per logit,
    # and the final norm's and output layer's bf16 inputs (2 + 2 B per hidden unit) stay
    head = (4 * M.vocab + 4 * M.hidden) * 8 * 2048 / 2**30
    assert compiled["activations_gib"] == pytest.approx(
        0.5 * base["activations_gib"] + 0.5 * head, rel=1e-6)
    assert compiled["optimizer_s"] == pytest.approx(2 * base["optimizer_s"])
    assert compiled["exposed_comm_s"] > base["exposed_comm_s"]  # leak of hidden traffic
    assert eager["compute_s"] > compiled["compute_s"] and eager["total_gib"] > compiled["total_gib"]


def test_activation_scale_falls_back_to_the_mode_without_recompute():
    gpu = calibrate_pieces.apply(_gpu(), {"activation_scales": [[True, "none", 0.7],
                                                                 [True, "selective", 0.9]]})
    got = calibrate_pieces.activation_scale(gpu, np.array([True, True, True, False]),
                                            np.array([0, 1, 2, 0]))
    assert got.tolist() == [0.7, 0.9, 0.7, 1.0]


def test_bad_pieces_in_a_calibration_file_are_refused_in_one_line(tmp_path):
    good = calibration.load("h200-sxm")
    path = tmp_path / "h200-sxm.yaml"
    path.write_text(calibrate.yaml.safe_dump({**good, "pieces": {"overlap_exposed": 3.0}}))
    with pytest.raises(calibration.CalibrationError, match="pieces") as err:
        calibration.apply(_gpu(), calibration.load("h200-sxm", path))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_two_rank_piece_benches_feed_a_calibration(tmp_path):
    """Real torchrun, 2 gloo ranks: block/head/optimizer/hbm/overlap records, then calibrate."""
    model = tmp_path / "tiny.yaml"
    model.write_text("n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n")
    out = tmp_path / "micro.jsonl"
    got, _ = run_micro(out, 2, "--model", str(model),
                       "--benches", "matmul,attention,hbm,head,block,optimizer,overlap",
                       "--block-modes", "eager:none,eager:selective", "--tokens", "128",
                       "--seq-len", "64", "--warmup", "1", "--iters", "2", "--repeats", "6",
                       timeout=240)
    benches = [r["bench"] for r in got]
    for bench in ("hbm", "head", "block", "optimizer", "overlap"):
        assert bench in benches
    blocks = [r for r in got if r["bench"] == "block"]
    assert [r["config"]["recompute"] for r in blocks] == ["none", "selective"]
    assert all(r["results"]["time_s"] > 0 for r in blocks)
    cpu = dataclasses.replace(_gpu(), name="cpu", bf16_tflops=0.5, hbm_tbps=0.2)  # CPU scale
    cal = calibrate.build([out], cpu)
    assert {"eager_elementwise_scale", "head_scale", "optimizer_scale", "overlap_exposed",
            "memory_efficiency"} <= set(cal["pieces"])
    assert len(cal["block_checks"]) == 2
    applied = calibration.apply(cpu, cal)
    got = cal["pieces"]["eager_elementwise_scale"]
    assert applied.eager_elementwise_scale == pytest.approx(got)


def test_head_peak_bytes_scale_the_logits_term():
    gpu = _gpu()
    analytic = float(calibrate_pieces.memory.logits_bytes(M, seq_len=2048, micro_batch=4, tp=1,
                                                           cp=1))
    head = {"config": {"model": M.name, "model_spec": dataclasses.asdict(M), "tokens": 8192,
                       "seq": 2048, "micro_batch": 4},
            "results": {"time_s": 0.01, "peak_bytes": 0.6 * analytic}}
    scales, _ = calibrate_pieces.fit({"head": [head]}, gpu)
    assert scales["logits_scale"] == pytest.approx(0.6)
    L = Layouts.from_configs([ParallelConfig(micro_batch=4)])
    # the head was measured with the eager loss: the scale prices eager runs only
    base = evaluate(M, gpu, load_cluster("dgx-h100"), L, 2048, compiled=False).iloc[0]
    cut = evaluate(M, calibrate_pieces.apply(gpu, scales), load_cluster("dgx-h100"), L,
                   2048, compiled=False).iloc[0]
    assert base["activations_gib"] - cut["activations_gib"] == pytest.approx(
        0.4 * 10 * 4 * 2048 * M.vocab / 2**30)
    compiled = [evaluate(M, g, load_cluster("dgx-h100"), L, 2048).iloc[0]["activations_gib"]
                for g in (gpu, calibrate_pieces.apply(gpu, scales))]
    assert compiled[0] == compiled[1]


# ---------------------------------------------------------------- layouts other than FSDP2


def _head(seconds, peak, *, compile=False, precision="pure", mb=4):
    return {"config": {"model": M.name, "model_spec": dataclasses.asdict(M), "tokens": mb * 2048,
                       "seq": 2048, "micro_batch": mb, "compile": compile,
                       "precision": precision},
            "results": {"time_s": seconds, "peak_bytes": peak}}


def test_autocast_blocks_get_their_own_scales_and_leave_the_pure_ones():
    gpu = _gpu()
    t, kept = _analytic_block(gpu)
    pure = _block(t["matmul"] + t["attention"] + 1.7 * t["elementwise"], 0.8 * kept)
    amp = _block(t["matmul"] + t["attention"] + 2.5 * t["elementwise"], 1.6 * kept)
    amp["config"]["precision"] = "autocast-fp32"
    scales, checks = calibrate_pieces.fit({"block": [pure, amp]}, gpu)
    assert scales["elementwise_scale"] == pytest.approx(1.7, rel=1e-3)
    assert scales["autocast_elementwise_scale"] == pytest.approx(2.5, rel=1e-3)
    assert scales["activation_scales"] == [[True, "none", 0.8]]
    assert scales["autocast_activation_scales"] == [[True, "none", 1.6]]
    assert [row["precision"] for row in checks] == ["pure", "autocast-fp32"]
    for row in checks:
        assert row["predicted_s"] == pytest.approx(row["measured_s"], rel=1e-3)
        assert row["predicted_mib"] == pytest.approx(row["measured_mib"], rel=1e-3)
    # both reach GPUSpec; the autocast activation table has no field (memory keeps its own)
    applied = calibrate_pieces.apply(gpu, scales)
    assert applied.elementwise_scale == pytest.approx(1.7, rel=1e-3)
    assert applied.autocast_elementwise_scale == pytest.approx(2.5, rel=1e-3)
    assert not hasattr(applied, "autocast_activation_scales")


def test_compiled_head_is_scaled_against_the_compiled_logits_bytes():
    gpu = _gpu()
    t = calibrate_pieces.head_time(M, gpu, 8192)
    kw = dict(seq_len=2048, micro_batch=4, tp=1, cp=1)
    eager = _head(1.3 * t, 0.6 * float(calibrate_pieces.memory.logits_bytes(M, **kw)))
    compiled = _head(0.8 * t, 0.9 * float(calibrate_pieces.memory.compiled_logits_bytes(M, **kw)),
                     compile=True)
    scales, _ = calibrate_pieces.fit({"head": [eager, compiled]}, gpu)
    assert scales["head_scale"] == pytest.approx(1.3, rel=1e-3)
    assert scales["logits_scale"] == pytest.approx(0.6, rel=1e-3)
    assert scales["compiled_head_scale"] == pytest.approx(0.8, rel=1e-3)
    assert scales["compiled_logits_scale"] == pytest.approx(0.9, rel=1e-3)
    assert [row[:2] for row in scales["head_modes"]] == [[False, "pure"], [True, "pure"]]
    alone, _ = calibrate_pieces.fit({"head": [eager]}, gpu)
    assert "head_modes" not in alone and "compiled_head_scale" not in alone


def _ddp(seconds, allreduce, *, on, kept=0):
    r = _block(seconds, kept, mb=8)
    r["config"].update({"precision": "autocast-fp32", "wrapper": "ddp", "optimize_ddp": on,
                        "grad_bytes": 4 * 50_000_000})
    r["results"]["allreduce_s"] = allreduce
    return r


def test_ddp_exposure_is_measured_against_the_block_alone_and_its_bucket_copies():
    gpu = _gpu()
    ref = _block(0.030, 0, mb=8)
    ref["config"]["precision"] = "autocast-fp32"
    copy = 16.0 * 50_000_000 / (gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)
    scales, checks = calibrate_pieces.fit({"block": [
        ref, _ddp(0.030 + copy + 0.3 * 0.004, 0.004, on=True),
        _ddp(0.030 + copy + 0.9 * 0.004, 0.004, on=False)]}, gpu)
    assert scales["ddp_exposed"] == pytest.approx(0.3, rel=1e-6)
    assert scales["ddp_exposed_unsplit"] == pytest.approx(0.9, rel=1e-6)
    assert len(checks) == 1  # the DDP rows are no block check
    fast, _ = calibrate_pieces.fit({"block": [ref, _ddp(0.020, 0.004, on=True)]}, gpu)
    assert fast["ddp_exposed"] == 0.0  # clamped
    bare, _ = calibrate_pieces.fit({"block": [_ddp(0.05, 0.004, on=True)]}, gpu)
    assert "ddp_exposed" not in bare  # no block alone to measure it against


def _mm(m, n, k, tflops, base=True, name="q"):
    return {"config": {"m": m, "n": n, "k": k, "base": base, "name": name},
            "results": {"tflops": tflops}}


def test_matmul_curve_interpolates_in_tokens_and_width_and_prices_a_block():
    peak = 1000.0
    recs = [_mm(4096, 2048, 2048, 600.0), _mm(16384, 2048, 2048, 800.0),
            _mm(16384, 2048, 2048, 820.0), _mm(16384, 8192, 2048, 700.0, base=False),
            _mm(4096, 8192, 2048, 500.0, base=False)]
    curve = calibrate_pieces.matmul_curve(recs, peak)
    w, wide = 2048.0 * 2048, 8192.0 * 2048
    assert curve == [[4096.0, w, 0.6], [4096.0, wide, 0.5], [16384.0, w, 0.81],
                     [16384.0, wide, 0.7]]
    at = calibrate_pieces.matmul_efficiency_at
    assert at(curve, 16384, w, 0.5) == pytest.approx(0.81)  # a measured shape
    assert at(curve, 8192, w, 0.5) == pytest.approx(0.705)  # log-tokens midpoint
    assert at(curve, 16384, 4096.0 * 2048, 0.5) == pytest.approx(0.755)  # log-width midpoint
    assert at(curve, 8192, 4096.0 * 2048, 0.5) == pytest.approx((0.55 + 0.755) / 2)
    # held flat outside the measured tokens and widths, never extrapolated
    assert at(curve, 1024, w, 0.5) == 0.6 and at(curve, 65536, w, 0.5) == 0.81
    assert at(curve, 16384, w / 8, 0.5) == 0.81 and at(curve, 16384, wide * 8, 0.5) == 0.7
    assert at([], 16384, w, 0.5) == 0.5
    assert np.allclose(at(curve, np.array([4096, 16384]), w, 0.5), [0.6, 0.81])
    eff = calibrate_pieces.block_matmul_efficiency
    assert eff(M, [], tokens=16384, tp=1, default=0.77) == pytest.approx(0.77)
    flat = [[1.0, 1.0, 0.7], [1e9, 1e12, 0.7]]
    assert eff(M, flat, tokens=np.array([4096, 16384]), tp=2, default=0.5) == pytest.approx(0.7)
    rising = [[1024.0, 1e5, 0.3], [1024.0, 1e8, 0.8], [65536.0, 1e5, 0.4], [65536.0, 1e8, 0.9]]
    tp1, tp2 = (eff(M, rising, tokens=16384, tp=t, default=0.5) for t in (1, 2))
    small = eff(M, rising, tokens=4096, tp=1, default=0.5)
    assert 0.3 < tp2 < tp1 <= 0.9 and small < tp1  # shards and small batches: smaller GEMMs
    scales, _ = calibrate_pieces.fit({"matmul": recs}, _gpu())
    assert len(scales["matmul_curve"]) == 4
    base_only, _ = calibrate_pieces.fit({"matmul": recs[:3]}, _gpu())
    assert "matmul_curve" not in base_only


def test_the_output_layer_has_its_own_curve_apart_from_the_block_gemms():
    """A small model's output layer (32000 x 2048) and a large model's MLP (14336 x 4096) are
    near one width n k; pooled, the block GEMM would be read at the output layer's rate."""
    peak = 1000.0
    recs = [_mm(4096, 2048, 2048, 600.0), _mm(4096, 32000, 2048, 570.0, name="output"),
            _mm(4096, 14336, 4096, 810.0, base=False, name="gate_up")]
    block = calibrate_pieces.matmul_curve(recs, peak)
    head = calibrate_pieces.matmul_curve(recs, peak, head=True)
    assert block == [[4096.0, 2048.0 * 2048, 0.6], [4096.0, 14336.0 * 4096, 0.81]]
    assert head == [[4096.0, 32000.0 * 2048, 0.57]]
    scales, _ = calibrate_pieces.fit({"matmul": recs}, _gpu())
    gpu = calibrate_pieces.apply(_gpu(), scales)
    assert gpu.head_matmul_curve == ((4096.0, 32000.0 * 2048, round(570 / gpu.bf16_tflops, 4)),)
    assert len(gpu.matmul_curve) == 2
    m8 = dataclasses.replace(M, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=32)
    assert calibrate_pieces.block_matmul_efficiency(
        m8, gpu.matmul_curve, tokens=4096, tp=1, default=0.5) > 0.75  # the MLP's own rate
    slow = compute.head_analytic_per_token(M, gpu, tokens=4096, tp=1)
    fast = compute.head_analytic_per_token(
        M, dataclasses.replace(gpu, head_matmul_curve=((4096.0, 1.0, 0.9),)), tokens=4096, tp=1)
    assert fast < slow  # the head reads its own curve
    pooled = dataclasses.replace(gpu, head_matmul_curve=())
    assert compute.head_analytic_per_token(M, pooled, tokens=4096, tp=1) != slow  # fallback


def test_ddp_block_scale_is_the_wrapped_block_less_its_copies_over_the_block_alone():
    gpu = _gpu()
    ref = _block(0.030, 0, mb=8)
    ref["config"]["precision"] = "autocast-fp32"
    copy = 16.0 * 50_000_000 / (gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)
    scales, _ = calibrate_pieces.fit({"block": [ref, _ddp(0.036 + copy, 0.004, on=True)]}, gpu)
    assert scales["ddp_block_scale"] == pytest.approx(1.2, rel=1e-6)
    assert calibrate_pieces.apply(gpu, scales).ddp_block_scale == pytest.approx(1.2, rel=1e-6)
    faster, _ = calibrate_pieces.fit({"block": [ref, _ddp(0.020, 0.004, on=True)]}, gpu)
    assert faster["ddp_block_scale"] == 1.0  # a wrapper never speeds a block up: noise


def test_apply_passes_a_piece_only_to_an_existing_scale_field():
    gpu = _gpu()
    out = calibrate_pieces.apply(gpu, {"name": "other", "bf16_tflops": 1.0, "head_scale": 2.0,
                                       "ddp_exposed": 0.4, "matmul_curve": [[1.0, 1.0, 0.5]]})
    assert out.name == gpu.name and out.bf16_tflops == gpu.bf16_tflops
    assert out.head_scale == 2.0


P_BLOCK = 50_000_000  # parameters of the synthetic FSDP2 block


def _fsdp(seconds, *, zero, ag=0.002, rs=0.003, alone=0.030, world=4):
    r = _block(seconds, 0, mb=8)
    r["config"].update({"precision": "pure", "wrapper": "fsdp2", "zero": zero, "world": world,
                        "params": P_BLOCK})
    r["results"].update({"allgather_s": ag, "reduce_scatter_s": rs})
    if alone is not None:
        r["results"]["alone_s"] = alone
    return r


def _fsdp_priced(gpu, zero, ag=0.002, rs=0.003, world=4):
    """What perf prices for the block besides its compute, all exposed: copies + collectives."""
    copy, _ = calibrate_pieces.compute.dp_copy_time(gpu, P_BLOCK, zero=zero, shard_ranks=world,
                                                    dp_ranks=world)
    return float(copy) + (2 if zero == 3 else 1) * ag + rs


def test_fsdp_block_scale_is_the_wrapped_block_less_what_perf_prices_over_the_block_alone():
    gpu = _gpu()
    slower = [_fsdp(1.2 * 0.030 + _fsdp_priced(gpu, z), zero=z) for z in (2, 3)]
    scales, checks = calibrate_pieces.fit({"block": slower}, gpu)
    assert scales["fsdp_block_scale"] == pytest.approx(1.2, rel=1e-6)
    assert scales["fsdp_block_scales"] == [[2, pytest.approx(1.2)], [3, pytest.approx(1.2)]]
    assert checks == []  # the wrapped rows are no block check
    assert calibrate_pieces.apply(gpu, scales).fsdp_block_scale == pytest.approx(1.2, rel=1e-6)
    # equal: the wrapped block is the block plus exactly the copies and collectives perf
    # prices (ZeRO-3 gathers twice), however large the collectives are
    for ag, rs in ((0.002, 0.003), (0.050, 0.080)):
        equal = [_fsdp(0.030 + _fsdp_priced(gpu, z, ag, rs), zero=z, ag=ag, rs=rs)
                 for z in (2, 3)]
        same, _ = calibrate_pieces.fit({"block": equal}, gpu)
        assert same["fsdp_block_scale"] == 1.0
        assert same["fsdp_block_scales"] == [[2, 1.0], [3, 1.0]]
    faster, _ = calibrate_pieces.fit({"block": [_fsdp(0.020, zero=2)]}, gpu)
    assert faster["fsdp_block_scale"] == 1.0  # a wrapper never speeds a block up: noise


def test_fsdp_block_scale_by_zero_and_its_reference_block():
    gpu = _gpu()
    z2 = _fsdp(1.1 * 0.030 + _fsdp_priced(gpu, 2), zero=2)
    z3 = _fsdp(1.3 * 0.030 + _fsdp_priced(gpu, 3), zero=3)
    scales, _ = calibrate_pieces.fit({"block": [z2, z3, z3]}, gpu)
    assert scales["fsdp_block_scales"] == [[2, pytest.approx(1.1)], [3, pytest.approx(1.3)]]
    assert scales["fsdp_block_scale"] == pytest.approx(1.3)  # pooled median of the three
    # without its own alone_s: the plain pure block of the same shape; the DDP scales' and
    # the fits' blocks are unchanged by the wrapped one
    bare = _fsdp(1.25 * 0.040 + _fsdp_priced(gpu, 2), zero=2, alone=None)
    ref = _block(0.040, 0, mb=8)
    with_ref, _ = calibrate_pieces.fit({"block": [ref, bare]}, gpu)
    alone_only, _ = calibrate_pieces.fit({"block": [ref]}, gpu)
    assert with_ref["fsdp_block_scale"] == pytest.approx(1.25)
    assert {k: v for k, v in with_ref.items() if "fsdp" not in k} == alone_only
    other = _block(0.040, 0, mb=2)  # another shape: no reference
    assert "fsdp_block_scale" not in calibrate_pieces.fit({"block": [other, bare]}, gpu)[0]
    assert calibrate_pieces.fit({"block": [ref]}, gpu)[0].get("fsdp_block_scale") is None
    out = calibrate_pieces.apply(gpu, scales)
    assert out.fsdp_block_scale == pytest.approx(1.3) and out.ddp_block_scale == 1.0
