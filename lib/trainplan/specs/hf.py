"""Hugging Face Llama configs <-> `ModelSpec`, and our tensor names <-> transformers'.

`model_from_hf` reads the `config.json` of a `LlamaForCausalLM` (as
transformers 4 writes it, `rope_theta` at the top, or 5, inside
`rope_parameters`) into a `ModelSpec`; `hf_config` writes the `config.json`
under which transformers builds a `LlamaForCausalLM` computing the same
function as `bench.harness.model.Transformer` for that spec: SwiGLU with SiLU,
rotate-half RoPE of base `rope_theta`, RMSNorm of `norm_eps`, grouped-query
attention, biases in every linear layer or none. Only what that function
reads is taken; anything that would change it and that the Transformer cannot
compute (another architecture, RoPE scaling, another activation) is refused
with one `SpecError` line naming the file, the field and what is valid.

Pure Python (`trainplan.loader` reads the JSON), no torch and no transformers,
so the planner can read an HF model without either installed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from trainplan.errors import PresetNotFound, SpecError
from trainplan.loader import load_json, quote, shown
from trainplan.specs.model import ModelSpec

CONFIG = "config.json"
MAX_CONFIG_BYTES = 1 << 20  # a Llama config.json is ~1 KB; anything this big is not one
ARCHITECTURE = "LlamaForCausalLM"
DTYPES = ("float32", "bfloat16")
# transformers' LlamaConfig defaults, taken where a config leaves the field out (as it does)
HF_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
# Why the model types people try most are not Llama, for the refusal
_OTHER_TYPES = {"mistral": "sliding-window attention", "mixtral": "a mixture of experts",
                "gpt2": "GELU, LayerNorm and learned positions", "qwen2": "QKV biases only",
                "gemma": "GeGLU and scaled embeddings"}

# Our module names -> transformers' LlamaForCausalLM names: inside decoder layer i
# (`layers.{i}.` -> `model.layers.{i}.`), then outside the layers.
HF_LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                  "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                  "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                  "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                  "ffn_norm": "post_attention_layernorm"}
HF_ROOT_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm",
                 "output": "lm_head"}
_OURS_IN_LAYER = {v: k for k, v in HF_LAYER_NAMES.items()}
_OURS_AT_ROOT = {v: k for k, v in HF_ROOT_NAMES.items()}
_OUR_KEY = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)|(\w+)\.(weight|bias)")
_HF_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)|(.+)\.(weight|bias)")


# ---------------------------------------------------------------- config.json -> ModelSpec


def model_from_hf(path) -> ModelSpec:
    """The `ModelSpec` of a Llama `config.json` (the file, or a folder holding one).

    name: the folder's name (`hf:<stem>` for a file not called config.json);
    source: the path. Sizes must be positive whole numbers; `rope_theta` and
    `rms_norm_eps` default to transformers' 10000 and 1e-6 where left out.
    """
    file = _config_file(Path(path))
    cfg = _read_json(file)
    where = str(file)
    model_type = cfg.get("model_type")
    if model_type != "llama":
        why = f" ({_OTHER_TYPES[model_type]})" if isinstance(model_type, str) and (
            model_type in _OTHER_TYPES) else ""
        raise SpecError(f"{where}: model_type = {quote(model_type)}{why} is not supported; "
                        f"use a Llama config (model_type 'llama', {ARCHITECTURE})")
    archs = cfg.get("architectures")
    if archs is not None and archs != [ARCHITECTURE]:
        raise SpecError(f"{where}: architectures = {quote(archs)} is not supported; "
                        f"use [{ARCHITECTURE!r}]")
    act = cfg.get("hidden_act", HF_DEFAULTS["hidden_act"])
    if act != "silu":
        raise SpecError(f"{where}: hidden_act = {quote(act)} is not supported; use 'silu' (SwiGLU)")
    size = {field: _whole(cfg, field, where) for field in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
        "vocab_size")}
    heads = size["num_attention_heads"]
    kv_heads = (_whole(cfg, "num_key_value_heads", where)
                if cfg.get("num_key_value_heads") is not None else heads)
    if size["hidden_size"] % heads:
        raise SpecError(f"{where}: hidden_size = {size['hidden_size']} is not divisible by "
                        f"num_attention_heads = {heads}")
    if heads % kv_heads:
        raise SpecError(f"{where}: num_key_value_heads = {kv_heads} is not valid; it must "
                        f"divide num_attention_heads = {heads}")
    if cfg.get("head_dim") is not None and _whole(cfg, "head_dim", where) != (
            size["hidden_size"] // heads):
        raise SpecError(f"{where}: head_dim = {cfg['head_dim']} is not supported; it must be "
                        f"hidden_size / num_attention_heads = {size['hidden_size'] // heads}")
    bias = {f: _flag(cfg, f, where) for f in ("attention_bias", "mlp_bias")}
    if bias["attention_bias"] != bias["mlp_bias"]:
        raise SpecError(f"{where}: attention_bias = {bias['attention_bias']} and mlp_bias = "
                        f"{bias['mlp_bias']} are not supported together; both must be equal")
    name = file.parent.resolve().name if file.name == CONFIG else f"hf:{file.stem}"
    theta = _rope_theta(cfg, where)
    eps = _number(cfg.get("rms_norm_eps", HF_DEFAULTS["rms_norm_eps"]), "rms_norm_eps", where)
    tied = _flag(cfg, "tie_word_embeddings", where)
    try:
        return ModelSpec(
            name=name or "hf", n_layers=size["num_hidden_layers"], hidden=size["hidden_size"],
            n_heads=heads, n_kv_heads=kv_heads, ffn=size["intermediate_size"],
            vocab=size["vocab_size"], tied_embeddings=tied,
            bias=bias["attention_bias"], rope_theta=theta, norm_eps=eps, source=str(path))
    except SpecError as err:  # e.g. a size beyond MAX_INT
        raise SpecError(f"{where}: {err}") from None


def _config_file(path: Path) -> Path:
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise PresetNotFound(f"{path} is a directory without a {CONFIG}; give a model "
                                 f"preset, a YAML file, a Hugging Face model folder or its "
                                 f"{CONFIG}")
        return path / CONFIG
    if not path.is_file():
        raise PresetNotFound(f"{path}: no such file or folder; give a Hugging Face model folder "
                             f"or its {CONFIG}")
    return path


def _read_json(file: Path) -> dict:
    cfg = load_json(file, max_bytes=MAX_CONFIG_BYTES, what=CONFIG)
    if not isinstance(cfg, dict):
        raise SpecError(f"{shown(file)}: expected a JSON object of config fields, "
                        f"got {type(cfg).__name__}")
    return cfg


def _whole(cfg: dict, field: str, where: str) -> int:
    if field not in cfg:
        raise SpecError(f"{where}: missing field {field!r}; a Llama {CONFIG} needs it "
                        "(a whole number > 0)")
    value = cfg[field]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{where}: {field} = {quote(value)} is not valid; use a whole number > 0")
    return value


def _number(value, field: str, where: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise SpecError(f"{where}: {field} = {quote(value)} is not valid; use a finite number > 0")
    return float(value)


def _flag(cfg: dict, field: str, where: str) -> bool:
    value = cfg.get(field, HF_DEFAULTS[field])
    if not isinstance(value, bool):
        raise SpecError(f"{where}: {field} = {quote(value)} is not valid; use true or false")
    return value


def _rope_theta(cfg: dict, where: str) -> float:
    """The RoPE base, from `rope_parameters` (transformers 5) or the top level (4);
    any scaling (`rope_type` other than 'default') is refused."""
    found = [("rope_theta", cfg["rope_theta"])] if "rope_theta" in cfg else []
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise SpecError(f"{where}: {field} = {quote(rope)} is not valid; use an object "
                            "with rope_type 'default'")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise SpecError(f"{where}: {field}.rope_type = {quote(kind)}: RoPE scaling is not "
                            "supported; only rope_type 'default' (plain RoPE)")
        if "rope_theta" in rope:
            found.append((f"{field}.rope_theta", rope["rope_theta"]))
    values = {_number(value, label, where): label for label, value in found}
    if len(values) > 1:
        raise SpecError(f"{where}: {' and '.join(values.values())} disagree "
                        f"({', '.join(map(str, values))}); give one RoPE base")
    return next(iter(values), HF_DEFAULTS["rope_theta"])


# ---------------------------------------------------------------- ModelSpec -> config.json


def hf_config(spec: ModelSpec, max_positions: int, *, dtype: str = "float32",
              bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """The `config.json` (a dict) under which transformers builds a `LlamaForCausalLM`
    computing what our `Transformer` computes for `spec`.

    `max_positions`: the longest sequence the model is meant for (tokens), HF's
    `max_position_embeddings` (RoPE has no table to size; it is metadata).
    `dtype`: that of the weights written beside it. RoPE's base is written both
    at the top (transformers 4 reads it there) and in `rope_parameters` (5).
    """
    for field, want in (("mlp", "swiglu"), ("positions", "rope"), ("norm", "rmsnorm")):
        if getattr(spec, field) != want:
            raise SpecError(f"model {quote(spec.name)}: {field} = {getattr(spec, field)!r} has no "
                            f"Hugging Face Llama form; {ARCHITECTURE} needs {want!r}")
    if spec.is_moe:
        raise SpecError(f"model {quote(spec.name)}: n_experts = {spec.n_experts} has no Hugging "
                        f"Face Llama form; {ARCHITECTURE} is dense (n_experts 1)")
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or (
            max_positions <= 0):
        raise SpecError(f"max_positions = {quote(max_positions)} is not valid; use a whole "
                        "number > 0 (the longest sequence, in tokens)")
    if dtype not in DTYPES:
        raise SpecError(f"dtype = {quote(dtype)} is not valid; use one of {list(DTYPES)}")
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "dtype": dtype,
        "vocab_size": spec.vocab, "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn, "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_positions, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": spec.bias, "mlp_bias": spec.bias, "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tied_embeddings, "initializer_range": 0.02,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": None,
        "pretraining_tp": 1, "use_cache": True,
    }


# ---------------------------------------------------------------- tensor names


def to_hf_names(state: dict) -> dict:
    """`state` (our `Transformer` names) under transformers' `LlamaForCausalLM` names;
    values untouched. A name with no HF form (`pos_embeddings`) is a SpecError."""
    out = {}
    for key, value in state.items():
        m = _OUR_KEY.fullmatch(key)
        if m and m[1] is not None and m[2] in HF_LAYER_NAMES:
            out[f"model.layers.{m[1]}.{HF_LAYER_NAMES[m[2]]}.{m[3]}"] = value
        elif m and m[4] in HF_ROOT_NAMES:
            out[f"{HF_ROOT_NAMES[m[4]]}.{m[5]}"] = value
        else:
            raise SpecError(f"tensor {quote(key)} has no Hugging Face Llama name; known: "
                            f"layers.N.{{{', '.join(HF_LAYER_NAMES)}}}, "
                            f"{', '.join(HF_ROOT_NAMES)}")
    return out


def from_hf_names(state: dict) -> dict:
    """`state` (transformers' Llama names) under our `Transformer` names; the inverse
    of `to_hf_names`. A name that is not a Llama tensor is a SpecError."""
    out = {}
    for key, value in state.items():
        m = _HF_KEY.fullmatch(key)
        if m and m[1] is not None and m[2] in _OURS_IN_LAYER:
            out[f"layers.{m[1]}.{_OURS_IN_LAYER[m[2]]}.{m[3]}"] = value
        elif m and m[1] is None and m[4] in _OURS_AT_ROOT:
            out[f"{_OURS_AT_ROOT[m[4]]}.{m[5]}"] = value
        else:
            raise SpecError(f"tensor {quote(key)} is not one of {ARCHITECTURE}'s; known: "
                            f"model.layers.N.{{{', '.join(HF_LAYER_NAMES.values())}}}, "
                            f"{', '.join(HF_ROOT_NAMES.values())}")
    return out
