"""Export to a Hugging Face folder, and back (`train.export`), checked by transformers itself.

Our `Transformer` and `transformers.LlamaForCausalLM.from_pretrained(out)`
must give the same logits (fp32, atol 1e-5) on random tokens: for weights in
memory (untied, tied, with biases) and for real DCP checkpoints written by
the harness in one process and by two torchrun ranks under ZeRO-3 (resharded
on load). Every norm weight is perturbed away from 1, so a swapped name shows.
Wrong input is refused in one line naming the value.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from trainplan.bench.ckpt import manifest as mf  # noqa: E402
from trainplan.bench.ckpt.dcp_io import CheckpointError, one_process  # noqa: E402
from trainplan.bench.harness.model import Transformer  # noqa: E402
from trainplan.errors import SpecError  # noqa: E402
from trainplan.specs import ModelSpec, load_model  # noqa: E402
from trainplan.train.export import (  # noqa: E402
    export_checkpoint,
    export_state,
    load_weights,
)

LIB = Path(__file__).resolve().parents[2] / "lib"
TINY = ModelSpec(name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128,
                 vocab=256, rope_theta=5e5, norm_eps=1e-6)
YAML = ("n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
        "rope_theta: 500000.0\nnorm_eps: 1.0e-6\n")
SEQ = 24


def ours(spec=TINY, seed=0) -> Transformer:
    """Seeded init, then every parameter moved (norms off 1, biases off 0)."""
    torch.manual_seed(seed)
    model = Transformer(spec, max_seq_len=SEQ)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def theirs(out: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def assert_same_logits(a, b, spec=TINY) -> None:
    x = torch.randint(spec.vocab, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = (getattr(y, "logits", y) for y in (a(x), b(x)))  # HF's output: .logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("change", [{}, {"tied_embeddings": True}, {"bias": True}])
def test_exported_state_loads_in_transformers_with_our_logits(tmp_path, change):
    spec = dataclasses.replace(TINY, **change)
    model = ours(spec)
    out = export_state(model.state_dict(), spec, tmp_path / "hf", max_positions=SEQ)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    names = safetensors_torch.load_file(out / "model.safetensors").keys()
    assert ("lm_head.weight" in names) == (not spec.tied_embeddings)  # the table written once
    per_layer = 9 + 7 * spec.bias  # 7 linear layers, 2 norms; a bias in each linear layer
    assert len(names) == 2 + per_layer * spec.n_layers + (not spec.tied_embeddings)
    hf = theirs(out)
    assert hf.config.tie_word_embeddings == spec.tied_embeddings
    assert_same_logits(model, hf, spec)
    back = Transformer(spec, max_seq_len=SEQ)
    load_weights(back, out)
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_bfloat16_export_is_the_rounded_weights(tmp_path):
    model = ours()
    out = export_state(model.state_dict(), TINY, tmp_path / "bf16", dtype="bfloat16",
                       max_positions=SEQ)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.LlamaForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16
    back = Transformer(TINY, max_seq_len=SEQ)
    load_weights(back, out)
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value.bfloat16().float()), key


def test_weights_saved_by_transformers_sharded_load_into_ours(tmp_path):
    """HF's own save_pretrained, split into shards with an index, read by load_weights."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="60KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = Transformer(load_model(str(tmp_path / "hf")), max_seq_len=SEQ)
    load_weights(model, tmp_path / "hf")
    assert_same_logits(hf, model.eval())


# ---------------------------------------------------------------- real checkpoints


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                TRAINPLAN_FAULT="", PYTHONPATH=os.pathsep.join(
                    [str(LIB), os.environ.get("PYTHONPATH", "")]))


def harness(work: Path, name: str, yaml: str, *launch: str, flags=()) -> Path:
    """Three steps of the harness on CPU with checkpoints every step; the run's folder."""
    (work / f"{name}.yaml").write_text(yaml)
    cmd = [sys.executable, *launch, "-m", "trainplan.bench.harness.train", "--cpu",
           "--synthetic", "--model", str(work / f"{name}.yaml"), "--steps", "3", "--warmup",
           "1", "--seq-len", "16", "--ckpt-dir", str(work / name), "--ckpt-every", "1",
           "--json", "--lr", "3e-3", *flags]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / name


def loaded(step_dir: Path, spec: ModelSpec) -> Transformer:
    """Our model with the checkpoint's weights, read by DCP directly (not by export)."""
    import torch.distributed.checkpoint as dcp

    model = Transformer(spec, max_seq_len=SEQ)
    state = {"model": model.state_dict()}
    with one_process():
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    return harness(tmp_path_factory.mktemp("ckpt"), "one", YAML)


def test_checkpoint_of_one_process_exports_its_newest_step(one_rank, tmp_path):
    spec = load_model(str(one_rank.parent / "one.yaml"))
    assert [d.name for _, d in mf.step_dirs(one_rank)] == ["step-000003", "step-000002"]
    out = export_checkpoint(one_rank, spec, tmp_path / "hf", max_positions=SEQ)
    newest, before = loaded(one_rank / "step-000003", spec), loaded(one_rank / "step-000002", spec)
    assert not torch.equal(newest.output.weight, before.output.weight)  # a step apart
    assert_same_logits(newest, theirs(out), spec)
    older = export_checkpoint(one_rank / "step-000002", spec, tmp_path / "old",
                              max_positions=SEQ)
    assert_same_logits(before, theirs(older), spec)


@pytest.mark.slow
def test_zero3_checkpoint_of_two_ranks_is_resharded_on_export(tmp_path):
    """torchrun, 2 gloo ranks, FSDP2 ZeRO-3, tied embeddings: one shard file per rank."""
    spec = dataclasses.replace(TINY, tied_embeddings=True)
    run = harness(tmp_path, "two", YAML + "tied_embeddings: true\n", "-m",
                  "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  flags=("--dp", "2", "--zero", "3"))
    step = run / "step-000003"
    assert len(list(step.glob("*.distcp"))) == 2
    out = export_checkpoint(step, spec, tmp_path / "hf", max_positions=SEQ)
    hf = theirs(out)
    assert "lm_head.weight" not in safetensors_torch.load_file(out / "model.safetensors")
    assert_same_logits(loaded(step, spec), hf, spec)


# ---------------------------------------------------------------- refusals


def test_a_checkpoint_of_another_model_names_the_tensor(one_rank, tmp_path):
    wider = dataclasses.replace(TINY, ffn=192)
    with pytest.raises(SpecError) as err:
        export_checkpoint(one_rank, wider, tmp_path / "hf", max_positions=SEQ)
    assert "'layers.0.feed_forward.w1.weight' is [128, 64]" in one_line(err)
    assert "[192, 64]" in str(err.value)
    deeper = dataclasses.replace(TINY, n_layers=3)
    with pytest.raises(SpecError, match="no tensor 'layers.2.attention_norm.weight'"):
        export_checkpoint(one_rank, deeper, tmp_path / "hf", max_positions=SEQ)
    shallower = dataclasses.replace(TINY, n_layers=1)
    with pytest.raises(SpecError, match="'layers.1.attention_norm.weight' is not in"):
        export_checkpoint(one_rank, shallower, tmp_path / "hf", max_positions=SEQ)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.iterdir())


def test_a_corrupt_or_absent_checkpoint_is_refused(one_rank, tmp_path):
    bad = tmp_path / "step-000003"
    shutil.copytree(one_rank / "step-000003", bad)
    shard = next(bad.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, the size unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch") as err:
        export_checkpoint(bad, TINY, tmp_path / "hf", max_positions=SEQ)
    one_line(err)
    with pytest.raises(CheckpointError, match="no verified checkpoint"):
        export_checkpoint(tmp_path, TINY, tmp_path / "hf", max_positions=SEQ)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        export_checkpoint(tmp_path / "absent", TINY, tmp_path / "hf", max_positions=SEQ)


def test_an_existing_out_folder_is_refused_unless_empty(tmp_path):
    state = ours().state_dict()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "README.md").write_text("mine")
    with pytest.raises(SpecError, match="full: exists and is not an empty folder") as err:
        export_state(state, TINY, tmp_path / "full", max_positions=SEQ)
    one_line(err)
    assert (tmp_path / "full" / "README.md").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    export_state(state, TINY, tmp_path / "empty", max_positions=SEQ)
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # no temporary left


def test_wrong_states_specs_and_files_are_one_line(tmp_path):
    state = ours().state_dict()
    with pytest.raises(SpecError, match="mlp = 'gelu'"):
        export_state(state, dataclasses.replace(TINY, mlp="gelu"), tmp_path / "a",
                     max_positions=SEQ)
    with pytest.raises(SpecError, match="'tok_embeddings.weight' is \\[256, 64\\]") as err:
        export_state(state, dataclasses.replace(TINY, vocab=300), tmp_path / "a",
                     max_positions=SEQ)
    one_line(err)
    with pytest.raises(SpecError, match="not trained tied"):  # two tables, not one
        export_state(state, dataclasses.replace(TINY, tied_embeddings=True), tmp_path / "a",
                     max_positions=SEQ)
    out = export_state(state, TINY, tmp_path / "hf", max_positions=SEQ)
    other = Transformer(dataclasses.replace(TINY, n_kv_heads=4), max_seq_len=SEQ)
    with pytest.raises(SpecError, match="num_key_value_heads|n_kv_heads") as err:
        load_weights(other, out)  # the folder's config.json disagrees
    one_line(err)
    with pytest.raises(SpecError, match="'model.layers.0.self_attn.k_proj.weight' \\(ours "
                                        "'layers.0.attention.wk.weight'\\) is \\[32, 64\\]"):
        load_weights(other, out / "model.safetensors")  # no config.json: the shapes say it
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(SpecError, match="not a readable safetensors file") as err:
        load_weights(Transformer(TINY, SEQ), tmp_path / "junk.safetensors")
    one_line(err)
    (tmp_path / "pickled").mkdir()
    with pytest.raises(SpecError, match="pytorch_model.bin"):
        load_weights(Transformer(TINY, SEQ), tmp_path / "pickled")
