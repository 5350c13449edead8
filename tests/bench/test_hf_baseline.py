"""The Hugging Face baseline: the same model as ours, trained by our loop (CPU, gloo).

What makes the side-by-side ratio fair is checked here: the baseline has
exactly our parameter count at 1.3B; given our weights it computes our
logits, loss and gradients; its decoder layers trace whole for per-layer
compile (fullgraph, as `parallelize.apply_compile` asks); and under FSDP2 on
two gloo ranks it trains with a single process's loss curve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from trainplan.bench.harness import (
    hf_baseline,  # noqa: E402
    train,
)
from trainplan.bench.harness.model import Transformer, count_params  # noqa: E402
from trainplan.bench.harness.step import cross_entropy  # noqa: E402
from trainplan.bench.series import sidebyside, suite
from trainplan.cost import params  # noqa: E402
from trainplan.errors import LayoutError, SpecError  # noqa: E402
from trainplan.specs import ModelSpec, ParallelConfig, load_model  # noqa: E402

TINY = ModelSpec(name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256)
ROOT = Path(__file__).resolve().parents[2]


def _pair(spec=TINY, seq=32):
    torch.manual_seed(0)
    ours = Transformer.from_spec(spec, max_seq_len=seq)
    theirs = hf_baseline.HFCausalLM(spec, seq)
    theirs.load_state_dict(hf_baseline.hf_state_from_trainplan(ours.state_dict()), strict=True)
    return ours, theirs


def test_param_count_of_the_13b_proxy_on_meta():
    spec = load_model("llama-1.3b")
    with torch.device("meta"):
        theirs = hf_baseline.HFCausalLM(spec, 2048)
        ours = Transformer.from_spec(spec, max_seq_len=2048)
    assert count_params(theirs) == count_params(ours) == params.total_params(spec)
    cfg = theirs.hf.config
    assert (cfg.use_cache, cfg._attn_implementation, cfg.tie_word_embeddings) == (
        False, "sdpa", False)


def test_same_weights_same_logits_loss_and_gradients():
    """Renamed state loads strictly; logits, loss and every gradient agree in fp32."""
    ours, theirs = _pair()
    x, y = torch.randint(TINY.vocab, (3, 32)), torch.randint(TINY.vocab, (3, 32))
    a, b = ours(x), theirs(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    la, lb = cross_entropy(a, y), cross_entropy(b, y)
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-7)
    la.backward()
    lb.backward()
    grads = hf_baseline.hf_state_from_trainplan(
        {k: p.grad for k, p in ours.named_parameters()})
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-7)


def test_meta_build_materialises_like_a_direct_one():
    """to_empty + init_weights: finite weights, our init scales, the real rotary table."""
    with torch.device("meta"):
        model = hf_baseline.HFCausalLM(TINY, 32)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    direct = hf_baseline.HFCausalLM(TINY, 32)
    torch.testing.assert_close(model.hf.model.rotary_emb.inv_freq,
                               direct.hf.model.rotary_emb.inv_freq)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    down = model.hf.model.layers[0].mlp.down_proj.weight
    assert down.std().item() < 0.02 / 1.5  # residual projections scaled down, as ours


def test_decoder_layer_traces_as_one_graph():
    """apply_compile uses fullgraph=True: a graph break in HF's layer would fail the GPU run."""
    _, theirs = _pair()
    layer = theirs.hf.model.layers[0]
    layer.compile(backend="eager", fullgraph=True)
    theirs(torch.randint(TINY.vocab, (2, 32))).sum().backward()


@pytest.mark.parametrize("change, error", [
    (dict(mlp="gelu"), SpecError), (dict(tied_embeddings=True), SpecError)])
def test_non_llama_models_are_refused(change, error):
    import dataclasses

    with pytest.raises(error, match="hf-baseline"):
        hf_baseline.check(dataclasses.replace(TINY, **change), ParallelConfig())


def test_model_parallel_layouts_are_refused():
    with pytest.raises(LayoutError, match="tp = 2"):
        hf_baseline.check(TINY, ParallelConfig(tp=2))


def test_suite_configs_launch_the_right_module():
    loaded = suite.load_suite(str(ROOT / "data/suites/baseline-2gpu.yaml"))
    tags = [c["tag"] for c in loaded["configs"]]
    assert len(tags) == len(set(tags)) and sum(c.get("naive", False) for c in
                                               loaded["configs"]) == 1
    spec = load_model(loaded["model"])
    for c in loaded["configs"]:
        cmd = suite.train_command(loaded, c, Path("/tmp/x"), "run")
        module = cmd[cmd.index("-m", 3) + 1]
        impl = c.get("impl", "trainplan")
        if impl == "hf-trainer":  # its own module (test_hf_trainer.py)
            assert module == "trainplan.bench.harness.hf_trainer" and "--impl" not in cmd
            continue
        assert module == "trainplan.bench.harness.train"
        assert cmd[-2:] == ["--impl", impl] if impl != "trainplan" else "--impl" not in cmd
        if impl == "hf-baseline":
            hf_baseline.check(spec, ParallelConfig(**suite.full_layout(c)))


def test_sidebyside_ratios():
    def done(rate_s):  # one launch: 10 steps of 1000 tokens/GPU at rate_s seconds each
        return [{"tokens_per_step": 2000, "ranks": 2, "step_times_s": [rate_s] * 10,
                 "flops_per_token": 1e9, "peak_tflops": 1.0, "peak_mem_reserved_gib": 1.0}]
    configs = [{"tag": "ours", "gpus": 2}, {"tag": "hf", "gpus": 2, "impl": "hf-baseline"},
               {"tag": "naive", "gpus": 2, "impl": "hf-baseline", "naive": True}]
    rows = [("ours", None, done(0.5)), ("hf", None, done(0.6)), ("naive", None, done(1.0))]
    out = sidebyside.compare(configs, rows)
    assert out["best_trainplan"] == "ours" and out["best_baseline"] == "hf"
    assert out["speedup_vs_best_baseline"] == pytest.approx(1.2)
    assert out["speedup_vs_naive"] == pytest.approx(2.0)
    assert out["intervals_overlap"] is False
    assert "1.200x" in sidebyside.format_comparison(out)


@pytest.mark.slow
def test_two_rank_fsdp2_baseline_trains_like_one_process(tmp_path):
    """torchrun, 2 gloo ranks, ZeRO-3: loss falls and matches one process accumulating both."""
    model = tmp_path / "tiny.yaml"
    model.write_text("n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\n"
                     "vocab: 256\n")
    base = ["--model", str(model), "--seq-len", "32", "--micro-batch", "2", "--steps", "8",
            "--warmup", "1", "--lr", "3e-3", "--synthetic", "--cpu", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "trainplan.bench.harness.train",
                           *base, "--impl", "hf-baseline", "--dp", "2", "--zero", "3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert got["impl"] == "hf-baseline" and "LlamaForCausalLM" in got["notes"][0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks: a tiny model drowns in thread hand-offs
    try:
        ref = train.run(train.parse_args([*base, "--grad-accum", "2", "--impl", "hf-baseline"]))
    finally:
        torch.set_num_threads(threads)
    assert ref["impl"] == "hf-baseline"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-4, atol=0)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0)
    assert got["losses"][-1] < got["losses"][0]
