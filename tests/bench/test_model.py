"""The proxy model and the single-process pieces of the harness (fast, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainplan.bench.harness import feed
from trainplan.bench.harness import parallelize as pz
from trainplan.bench.harness.model import Transformer, count_params, flop_params, slice_spec
from trainplan.errors import LayoutError, SpecError
from trainplan.specs import ModelSpec, ParallelConfig, load_model

TINY = ModelSpec(name="tiny", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256)
GPT_TINY = ModelSpec(name="gpt-tiny", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=256,
                     mlp="gelu", positions="learned", max_positions=64, norm="layernorm",
                     bias=True, tied_embeddings=True)


def _model(spec=TINY, seed=0):
    torch.manual_seed(seed)
    return Transformer.from_spec(spec, max_seq_len=64)


def test_logits_shape():
    x = torch.randint(TINY.vocab, (3, 16))
    assert _model()(x).shape == (3, 16, TINY.vocab)  # (B, S, V)


@pytest.mark.parametrize("spec", [TINY, GPT_TINY], ids=["llama", "gpt"])
def test_causal_mask(spec):
    """Changing token t changes no logits before t, and does change those from t on."""
    model = _model(spec).eval()
    x = torch.randint(spec.vocab, (2, 24))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % spec.vocab
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().amax() > 1e-4


@pytest.mark.parametrize("name, published", [("llama-7b", 6_738_415_616),
                                             ("llama-1.3b", None), ("llama-13b", None),
                                             ("gpt2-xl", 1_557_611_200)])
def test_param_count_matches_formula(name, published):
    """The built module (on meta: no memory) has exactly the analytical parameter count."""
    from trainplan.cost import params

    spec = load_model(name)
    with torch.device("meta"):
        model = Transformer.from_spec(spec)
    assert count_params(model) == params.total_params(spec)
    if published is not None:
        assert count_params(model) == published


def test_flop_params_leaves_out_the_input_table():
    model = _model()
    assert flop_params(model) == count_params(model) - TINY.vocab * TINY.hidden
    tied = _model(GPT_TINY)  # the tied table is the output layer's matmul: it counts
    pos = GPT_TINY.max_positions * GPT_TINY.hidden
    assert flop_params(tied) == count_params(tied) - pos


def test_gpt_style_ties_the_output_layer():
    model = _model(GPT_TINY)
    assert model.output.weight is model.tok_embeddings.weight


def test_moe_is_refused():
    with pytest.raises(SpecError, match="n_experts"):
        with torch.device("meta"):
            Transformer.from_spec(load_model("mixtral-8x7b"))


def test_slice_spec_keeps_width():
    s = slice_spec(load_model("llama-13b"), 2)
    assert (s.n_layers, s.hidden, s.n_heads, s.ffn) == (2, 5120, 40, 13824)
    assert s.name == "llama-13b-slice2"
    with pytest.raises(SpecError, match="n_layers"):
        slice_spec(TINY, 0)


def _block_input_dtypes(model, x):
    seen = []
    model.layers["0"].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    return seen


def test_one_gpu_carries_a_bf16_stream_under_autocast_only():
    """parallelize on one rank casts the stream to the autocast dtype after the embedding
    (the layout `cost.memory_runtime.fp32_stream` prices as bf16); the plain model, and
    the model outside autocast, keep the embedding's fp32."""
    x = torch.randint(TINY.vocab, (2, 16))
    assert _block_input_dtypes(_model(), x) == [torch.float32]
    par = pz.parallelize(_model(), ParallelConfig(), None)
    assert _block_input_dtypes(par.parts[0], x) == [torch.bfloat16]
    torch.testing.assert_close(par.parts[0].eval()(x), _model().eval()(x))  # no autocast


def test_compile_whole_or_by_block():
    """`whole` compiles the model as one graph and leaves its blocks alone; per block, each
    block is compiled and the model is not (`nn.Module.compile` sets _compiled_call_impl)."""
    whole, blocks = _model(), _model()
    pz.apply_compile(whole, whole=True)
    pz.apply_compile(blocks)
    compiled = lambda m: m._compiled_call_impl is not None  # noqa: E731
    assert compiled(whole) and not any(compiled(b) for b in whole.layers.values())
    assert not compiled(blocks) and all(compiled(b) for b in blocks.layers.values())


def test_stage_layers_partition():
    assert pz.stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert pz.stage_layers(4, 4) == [[0], [1], [2], [3]]


def test_pipeline_stages_compose_to_the_whole_model():
    """Stage 0 then stage 1 computes what the unsplit model does, with the same weights."""
    model = _model().eval()
    x = torch.randint(TINY.vocab, (2, 16))
    parts = [pz.split_stage(model, s, 2) for s in range(2)]
    assert list(parts[0].layers) == ["0", "1"] and list(parts[1].layers) == ["2", "3"]
    assert parts[1].tok_embeddings is None and parts[0].output is None
    with torch.no_grad():
        torch.testing.assert_close(parts[1](parts[0](x)), model(x))


@pytest.mark.parametrize("cfg, match", [
    (ParallelConfig(dp=2, ep=2), "ep > 1 is not implemented"),
    (ParallelConfig(tp=3), "tp = 3 does not divide"),
    (ParallelConfig(pp=8, grad_accum=8), "only 4 layers"),
    (ParallelConfig(pp=2, grad_accum=1), "grad_accum = 1"),
    (ParallelConfig(pp=2, grad_accum=3, pp_schedule="interleaved", pp_virtual=2), "multiple"),
])
def test_check_layout_refuses(cfg, match):
    with pytest.raises(LayoutError, match=match):
        pz.check_layout(cfg, TINY, cfg.world)


def test_check_layout_world_mismatch():
    with pytest.raises(LayoutError, match="--nproc-per-node 2"):
        pz.check_layout(ParallelConfig(dp=2), TINY, 4)


def test_tp_refuses_tied_gpt():
    with pytest.raises(LayoutError, match="untied"):
        pz.check_layout(ParallelConfig(tp=2), dataclasses.replace(GPT_TINY), 2)


def test_synthetic_batches_shard_the_same_global_batch():
    """dp ranks x grad_accum read exactly the rows a single process reads with dp x grad_accum."""
    kw = dict(vocab=256, seq_len=8, micro_batch=2, seed=3)
    single = feed.SyntheticBatches(grad_accum=4, dp_rank=0, dp=1, **kw).step(5)
    ranks = [feed.SyntheticBatches(grad_accum=2, dp_rank=r, dp=2, **kw).step(5) for r in (0, 1)]
    flat = [b for r in ranks for b in r]
    for (x1, y1), (x2, y2) in zip(single, flat, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = single[0]
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted
    assert not torch.equal(single[0][0], feed.SyntheticBatches(
        grad_accum=4, dp_rank=0, dp=1, **kw).step(6)[0][0])


def test_single_process_run_learns(tmp_path):
    """The loop end to end in-process: the loss of the learnable synthetic data falls."""
    import yaml

    from trainplan.bench.harness import train

    path = tmp_path / "tiny.yaml"
    fields = dataclasses.asdict(TINY)
    keys = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab")
    path.write_text(yaml.safe_dump({k: fields[k] for k in keys}))
    summary = train.run(train.parse_args(["--model", str(path), "--seq-len", "32", "--steps", "12",
                                          "--warmup", "2", "--lr", "1e-2", "--synthetic", "--cpu",
                                          "--json"]))
    losses = summary["losses"]
    assert len(losses) == 12 and len(summary["step_times_s"]) == 10
    assert losses[-1] < losses[0] - 0.05
    assert summary["tokens_per_step"] == 32 and summary["mfu"] is None


@pytest.mark.parametrize("argv, match", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "llama-1.3b", "--cp", "2", "--cpu"], "cp = 2: context parallel runs on GPUs"),
    (["--model", "llama-1.3b", "--cp", "2", "--seq-len", "30"], "cp = 2: context parallel"),
    (["--model", "llama-1.3b", "--dp", "2"], "--nproc-per-node 2"),
    (["--model", "llama-1.3b", "--zero", "5"], "zero = 5"),
    (["--model", "llama-1.3b", "--steps", "3", "--warmup", "3"], "--warmup = 3"),
    (["--model", "llama-1.3b", "--layers", "99"], "has only 24 layers"),
    (["--model", "llama-1.3b", "--cpu", "--records", "x.jsonl"], "records are for GPU runs"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, match, capsys):
    from trainplan.bench.harness import train

    assert train.main([*argv, "--synthetic", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and match in err


def test_write_record_appends_a_valid_measurement(tmp_path):
    """A GPU run's summary becomes a measurement record that trainplan.records.schema reads back."""
    from trainplan.bench.harness import train
    from trainplan.records import schema as records

    layout = {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 3, "dp_shard": 2,
              "micro_batch": 8, "grad_accum": 1, "recompute": "none", "compile": True,
              "sequence_parallel": True, "pp_schedule": "1f1b", "pp_virtual": 1}
    summary = {"model": "llama-1.3b", "impl": "hf-baseline", "layout": layout, "gpus": 2,
               "ranks": 2,
               "card": "NVIDIA H200", "seq_len": 2048, "synthetic": True,
               "step_times_s": [0.28, 0.27, 0.29], "tokens_per_step": 32768,
               "flops_per_token": 8.8e9, "peak_tflops": 989.0, "warmup_steps_dropped": 4,
               "peak_mem_reserved_gib": 44.1, "peak_mem_allocated_gib": 30.2,
               "losses": [10.8, 10.3, 10.6, 10.5], "grad_norms": [1.0, 2.0, 1.5, 1.2],
               "notes": [], "tag": "hf-z2-mb8",
               "loader": {"synthetic": True, "num_workers": 0, "prefetch_factor": None,
                          "pin_memory": False}}
    path = tmp_path / "m.jsonl"
    train.write_record(str(path), summary, "run-1")
    (rec,) = records.load(path)
    assert rec["tag"] == "hf-z2-mb8" and rec["loader"] == summary["loader"]
    assert rec["kind"] == "measurement" and rec["run_id"] == "run-1"
    assert rec["impl"] == "hf-baseline"  # the summary's impl, not a literal
    assert rec["tokens_per_s_per_gpu"] == pytest.approx(16384 * 3 / 0.84)
    assert rec["losses"] == summary["losses"]
