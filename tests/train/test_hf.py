"""Hugging Face Llama configs <-> ModelSpec (`specs.hf`), and `load_model` on them.

Round trips through our own `hf_config` and through transformers' own
`LlamaConfig.to_json_file`; every refusal is one line naming the file, the
field and the value.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainplan.errors import PresetNotFound, SpecError
from trainplan.specs import ModelSpec, load_model
from trainplan.specs.hf import (
    from_hf_names,
    hf_config,
    model_from_hf,
    to_hf_names,
)

TINY = ModelSpec(name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128,
                 vocab=256, rope_theta=5e5, norm_eps=1e-6)
COMPUTES = [f.name for f in dataclasses.fields(ModelSpec) if f.name not in ("name", "source")]
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 256, "rope_theta": 5e5, "rms_norm_eps": 1e-6}


def write(folder, cfg, name="config.json"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(cfg))
    return folder / name


def refused(path, *fragments):
    """model_from_hf(path) raises one SpecError line holding every fragment."""
    with pytest.raises(SpecError) as err:
        model_from_hf(path)
    text = str(err.value)
    assert "\n" not in text and all(f in text for f in fragments), text
    return text


def same(a: ModelSpec, b: ModelSpec) -> None:
    assert {f: getattr(a, f) for f in COMPUTES} == {f: getattr(b, f) for f in COMPUTES}


@pytest.mark.parametrize("change", [{}, {"tied_embeddings": True, "bias": True},
                                    {"n_kv_heads": 4, "rope_theta": 1e4, "norm_eps": 1e-5}])
def test_our_config_reads_back_as_the_same_spec(tmp_path, change):
    spec = dataclasses.replace(TINY, **change)
    file = write(tmp_path / "my-model", hf_config(spec, 128))
    got = model_from_hf(tmp_path / "my-model")
    same(got, spec)
    assert got.name == "my-model" and got.source == str(tmp_path / "my-model")
    assert model_from_hf(file) == dataclasses.replace(got, source=str(file))


def test_transformers_own_config_file_is_read(tmp_path):
    """LlamaConfig.to_json_file (transformers 5: RoPE base inside rope_parameters)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=3,
        num_hidden_layers=3, vocab_size=300, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    (tmp_path / "hf").mkdir()
    cfg.to_json_file(str(tmp_path / "hf" / "config.json"))
    assert "rope_theta" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    got = model_from_hf(tmp_path / "hf")
    same(got, ModelSpec(name="x", n_layers=3, hidden=96, n_heads=6, n_kv_heads=3, ffn=160,
                        vocab=300, tied_embeddings=True, rope_theta=250000.0, norm_eps=1e-5))


def test_transformers_4_style_and_defaults(tmp_path):
    """rope_theta at the top, rope_scaling null, no kv heads, eps and theta left out."""
    cfg = dict(LLAMA, rope_scaling=None)
    del cfg["num_key_value_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]
    got = model_from_hf(write(tmp_path, cfg, "llama2.json"))
    assert (got.name, got.n_kv_heads, got.rope_theta, got.norm_eps) == (
        "hf:llama2", 4, 10000.0, 1e-6)


def test_load_model_takes_a_config_file_a_folder_and_a_slice(tmp_path):
    write(tmp_path / "m", hf_config(dataclasses.replace(TINY, n_layers=6), 64))
    assert load_model(str(tmp_path / "m")).n_layers == 6
    assert load_model(str(tmp_path / "m" / "config.json")).n_layers == 6
    sliced = load_model(f"{tmp_path / 'm'}:2-layers")
    assert (sliced.n_layers, sliced.hidden, sliced.rope_theta) == (2, 64, 5e5)
    with pytest.raises(SpecError, match="has 6 layers"):
        load_model(f"{tmp_path / 'm'}:7-layers")
    assert load_model("llama-1.3b").name == "llama-1.3b"  # presets as before
    with pytest.raises(PresetNotFound, match="is a directory without a config.json"):
        load_model(str(tmp_path))


def test_hf_config_refuses_what_llama_cannot_express():
    for change, field in ((dict(mlp="gelu"), "mlp"), (dict(positions="learned",
                          max_positions=64), "positions"), (dict(norm="layernorm"), "norm"),
                          (dict(n_experts=4, top_k=2), "n_experts")):
        with pytest.raises(SpecError, match=f"{field} = ") as err:
            hf_config(dataclasses.replace(TINY, **change), 64)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="max_positions = 0"):
        hf_config(TINY, 0)
    with pytest.raises(SpecError, match="dtype = 'float16'"):
        hf_config(TINY, 64, dtype="float16")


@pytest.mark.parametrize("change, fragments", [
    ({"model_type": "gpt2"}, ("model_type = 'gpt2'", "not supported", "'llama'")),
    ({"model_type": "mistral", "sliding_window": 4096}, ("'mistral'", "sliding-window")),
    ({"model_type": "mixtral"}, ("'mixtral'", "mixture of experts")),
    ({"architectures": ["LlamaForSequenceClassification"]}, ("architectures",)),
    ({"hidden_size": "64"}, ("hidden_size = '64'", "whole number")),
    ({"hidden_size": 64.0}, ("hidden_size = 64.0", "whole number")),
    ({"num_hidden_layers": 0}, ("num_hidden_layers = 0", "> 0")),
    ({"vocab_size": True}, ("vocab_size = True",)),
    ({"rms_norm_eps": "1e-6"}, ("rms_norm_eps = '1e-6'", "finite number")),
    ({"tie_word_embeddings": "yes"}, ("tie_word_embeddings = 'yes'", "true or false")),
    ({"head_dim": 32}, ("head_dim = 32", "= 16")),
    ({"num_key_value_heads": 3}, ("num_key_value_heads = 3", "must divide")),
    ({"attention_bias": True}, ("attention_bias = True", "mlp_bias = False")),
    ({"hidden_act": "gelu"}, ("hidden_act = 'gelu'", "'silu'")),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     ("rope_scaling.rope_type = 'llama3'", "RoPE scaling is not supported")),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}},
     ("rope_parameters.rope_type = 'linear'", "not supported")),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     ("rope_theta", "disagree")),
])
def test_bad_configs_are_one_line_naming_the_value(tmp_path, change, fragments):
    file = write(tmp_path, dict(LLAMA, **change))
    refused(file, str(file), *fragments)


def test_missing_field_unreadable_and_oversized_files(tmp_path):
    cfg = dict(LLAMA)
    del cfg["intermediate_size"]
    refused(write(tmp_path / "a", cfg), "missing field 'intermediate_size'")
    (tmp_path / "bad.json").write_text('{"model_type": "llama",')
    refused(tmp_path / "bad.json", "bad.json", "not valid JSON", "line 1")
    (tmp_path / "latin1.json").write_bytes('{"model_type": "llama\xe9"}'.encode("latin-1"))
    refused(tmp_path / "latin1.json", "not UTF-8")
    (tmp_path / "list.json").write_text("[1, 2]")
    refused(tmp_path / "list.json", "expected a JSON object", "list")
    (tmp_path / "big.json").write_text(json.dumps(dict(LLAMA, pad="x" * (1 << 20))))
    refused(tmp_path / "big.json", "too large", "1,048,576")
    with pytest.raises(PresetNotFound, match="no such file"):
        model_from_hf(tmp_path / "absent.json")


def test_names_map_both_ways_and_refuse_strangers():
    ours = {"tok_embeddings.weight": 0, "layers.3.attention.wk.bias": 1,
            "layers.0.feed_forward.w3.weight": 2, "layers.0.ffn_norm.weight": 3,
            "norm.weight": 4, "output.weight": 5}
    theirs = to_hf_names(ours)
    assert theirs == {"model.embed_tokens.weight": 0, "model.layers.3.self_attn.k_proj.bias": 1,
                      "model.layers.0.mlp.up_proj.weight": 2,
                      "model.layers.0.post_attention_layernorm.weight": 3,
                      "model.norm.weight": 4, "lm_head.weight": 5}
    assert from_hf_names(theirs) == ours
    with pytest.raises(SpecError, match="'pos_embeddings.weight' has no Hugging Face"):
        to_hf_names({"pos_embeddings.weight": 0})
    with pytest.raises(SpecError, match="'model.layers.0.self_attn.rotary_emb.inv_freq'"):
        from_hf_names({"model.layers.0.self_attn.rotary_emb.inv_freq": 0})
