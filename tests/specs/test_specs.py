"""Specs and presets: validation names the field, the value and what is valid."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from trainplan.calibrate.store import load_gpu
from trainplan.errors import PresetNotFound, SpecError, TrainplanError
from trainplan.loader import quote
from trainplan.specs import (
    ClusterSpec,
    GPUSpec,
    ModelSpec,
    ParallelConfig,
    Scenario,
    load,
    load_cluster,
    load_model,
    load_scenario,
    preset_names,
)

MODEL_YAML = "n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 256\nvocab: 100\n"


def test_every_promised_preset_loads():
    assert {"llama-1.3b", "llama-7b", "llama-13b", "llama-70b", "mixtral-8x7b"} <= set(
        preset_names(ModelSpec))
    assert {"h100-sxm", "h200-sxm", "a100-80gb"} <= set(preset_names(GPUSpec))
    assert {"dgx-h100", "dgx-a100"} <= set(preset_names(ClusterSpec))
    for name in preset_names(ModelSpec):
        assert load_model(name).name == name
    for name in preset_names(GPUSpec):
        assert load_gpu(name).bf16_tflops > 0
    for name in preset_names(ClusterSpec):
        assert load_cluster(name).gpus_per_node in (4, 8)  # HGX 4-GPU boards and DGX nodes


def test_preset_shapes_from_the_issue():
    m = load_model("llama-13b")
    assert (m.n_layers, m.hidden, m.n_heads, m.ffn, m.vocab) == (40, 5120, 40, 13824, 32000)
    p = load_model("llama-1.3b")
    assert (p.n_layers, p.hidden, p.n_heads, p.ffn, p.vocab) == (24, 2048, 16, 5504, 32000)
    assert load_model("llama-70b").n_kv_heads == 8
    mx = load_model("mixtral-8x7b")
    assert (mx.n_experts, mx.top_k, mx.is_moe) == (8, 2, True)


def test_gpu_and_cluster_figures_from_facts():
    h100, h200, a100 = load_gpu("h100-sxm"), load_gpu("h200-sxm"), load_gpu("a100-80gb")
    assert (h100.bf16_tflops, h200.bf16_tflops, a100.bf16_tflops) == (989, 989, 312)
    assert (h100.hbm_tbps, h200.hbm_tbps, a100.hbm_tbps) == (3.35, 4.8, 2.0)
    dgx = load_cluster("dgx-h100")
    assert (dgx.intra_node_gbps, dgx.inter_node_gbps) == (450, 50)  # 900 both ways; 400 Gb/s
    assert load_cluster("dgx-a100").intra_node_gbps == 300


def test_default_scenario():
    s = load_scenario("llama-13b-32xh100")
    assert (s.model, s.gpu, s.cluster, s.gpus, s.seq_len) == (
        "llama-13b", "h100-sxm", "dgx-h100", 32, 4096)
    assert s.global_batch_tokens % s.seq_len == 0
    assert s.token_budget == 2.6e11  # written 2.6e+11 or 2.6e11: YAML 1.1 needs the sign


def test_kv_heads_default_to_heads():
    m = tiny_model()
    assert (m.n_kv_heads, m.head_dim, m.kv_dim, m.is_moe) == (4, 16, 64, False)


@pytest.mark.parametrize(("overrides", "fragment"), [
    (dict(n_layers=0), "n_layers = 0"),
    (dict(hidden=-64), "hidden = -64"),
    (dict(n_layers="4"), "n_layers = '4'"),
    (dict(n_layers=4.0), "n_layers = 4.0"),
    (dict(n_layers=True), "n_layers = True"),
    (dict(hidden=65), "hidden = 65 is not divisible by n_heads = 4"),
    (dict(n_kv_heads=3), "n_kv_heads = 3 must divide n_heads = 4"),
    (dict(mlp="relu"), "mlp = 'relu'"),
    (dict(n_experts=2, top_k=3), "top_k = 3 exceeds n_experts = 2"),
    (dict(positions="learned"), "max_positions"),
    (dict(bias="yes"), "bias = 'yes'"),
    (dict(max_positions=-1), "max_positions = -1"),
])
def test_model_spec_rejects(overrides, fragment):
    with pytest.raises(SpecError) as err:
        tiny_model(**overrides)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "fragment"), [
    (dict(matmul_efficiency=1.5), "matmul_efficiency = 1.5 is out of range; use 0.0001 to 1"),
    (dict(memory_gib=0), "memory_gib = 0"),
    (dict(bf16_tflops="fast"), "bf16_tflops = 'fast'"),
])
def test_gpu_spec_rejects(overrides, fragment):
    kw = dict(name="g", bf16_tflops=100.0, memory_gib=10.0, hbm_tbps=1.0,
              matmul_efficiency=0.5, attention_efficiency=0.5, memory_efficiency=0.5)
    kw.update(overrides)
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(")):
        GPUSpec(**kw)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_gpu_spec_rejects_non_finite_numbers(value):
    with pytest.raises(SpecError):
        GPUSpec(name="g", bf16_tflops=value, memory_gib=10.0, hbm_tbps=1.0,
                matmul_efficiency=0.5, attention_efficiency=0.5, memory_efficiency=0.5)


@pytest.mark.parametrize(("overrides", "fragment"), [
    (dict(dp=0), "dp = 0"),
    (dict(zero=4), "zero = 4"),
    (dict(dp=4, zero=3, dp_shard=3), "dp_shard = 3 must divide dp = 4"),
    (dict(dp=4, zero=0, dp_shard=2), "needs zero >= 1"),
    (dict(dp=2, ep=4), "ep = 4 must divide dp * cp = 2"),
    (dict(pp=2, pp_virtual=2), "needs pp_schedule 'interleaved'"),
    (dict(recompute="some"), "recompute = 'some'"),
    (dict(pp_schedule="zigzag"), "pp_schedule = 'zigzag'"),
])
def test_parallel_config_rejects(overrides, fragment):
    with pytest.raises(SpecError, match=fragment.replace("*", r"\*").replace("'", "'")):
        ParallelConfig(**overrides)


def test_parallel_config_defaults_and_world():
    cfg = ParallelConfig(dp=4, tp=2, pp=2, cp=2, zero=3)
    assert cfg.world == 32
    assert cfg.dp_shard == 4  # ZeRO shards over all of dp by default
    assert ParallelConfig(dp=4).dp_shard == 1  # DDP shards nothing
    assert ParallelConfig(dp=8, cp=2, ep=16).ep == 16  # ep borrows from dp x cp


def test_scenario_rejects_zero_gpus():
    with pytest.raises(SpecError, match="gpus = 0"):
        Scenario(model="m", gpu="g", cluster="c", gpus=0, seq_len=1, global_batch_tokens=1,
                 token_budget=1.0)


# ---------------------------------------------------------------- loading files


def test_yaml_path_loads_and_name_defaults_to_stem(tmp_path):
    path = tmp_path / "my-gpt.yaml"
    path.write_text(MODEL_YAML + "mlp: gelu\npositions: learned\nmax_positions: 128\n")
    m = load_model(str(path))
    assert (m.name, m.mlp, m.positions, m.max_positions) == ("my-gpt", "gelu", "learned", 128)


@pytest.mark.parametrize(("text", "fragment"), [
    ("n_layers: [1\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("", "expected a mapping"),
    ("n_layers: 2\nhidden: 64\n", "missing field 'ffn'"),
    (MODEL_YAML + "colour: blue\n", "unknown field 'colour'"),
    (MODEL_YAML.replace("n_layers: 2", "n_layers: two"), "n_layers = 'two'"),
    (MODEL_YAML.replace("vocab: 100", "vocab: -100"), "vocab = -100"),
    (MODEL_YAML.replace("vocab: 100", "vocab: 1e3"), "vocab = '1e3'"),  # whole number fields
])
def test_bad_yaml_files(tmp_path, text, fragment):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_model(str(path))
    assert fragment in str(err.value)
    assert str(path) in str(err.value)


def test_binary_file_is_a_spec_error(tmp_path):
    path = tmp_path / "junk.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SpecError, match="not UTF-8 text"):
        load_model(str(path))


def test_unknown_preset_names_the_presets():
    with pytest.raises(PresetNotFound) as err:
        load_model("llama-9000b")
    assert "'llama-9000b'" in str(err.value) and "llama-13b" in str(err.value)
    with pytest.raises(PresetNotFound, match="unknown gpu 'b200'"):
        load_gpu("b200")
    with pytest.raises(PresetNotFound, match="unknown cluster"):
        load_cluster("nope")


def test_missing_file_is_preset_not_found(tmp_path):
    with pytest.raises(PresetNotFound, match="no such file"):
        load(ModelSpec, str(tmp_path / "absent.yaml"))


def test_yaml_exponent_without_sign_is_a_number(tmp_path):
    """YAML 1.1 reads 1e3 as a string; float fields take it as the number meant."""
    path = tmp_path / "g.yaml"
    path.write_text("bf16_tflops: 1e3\nmemory_gib: 80\nhbm_tbps: 3\nmatmul_efficiency: 0.8\n"
                    "attention_efficiency: 0.4\nmemory_efficiency: 0.9\n")
    assert load_gpu(str(path)).bf16_tflops == 1000.0


def test_errors_share_one_base_class():
    assert issubclass(PresetNotFound, SpecError) and issubclass(SpecError, TrainplanError)


def test_yaml_with_mixed_key_types_is_a_spec_error(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("{n_layers: 2, hidden: 64, n_heads: 4, ffn: 256, vocab: 100, 1: 2, foo: 3}\n")
    with pytest.raises(SpecError, match="unknown field"):
        load_model(str(path))


def test_layer_slice_keeps_the_width_and_names_itself():
    full, cut = load_model("llama-13b"), load_model("llama-13b:4-layers")
    assert cut.n_layers == 4 and cut.name == "llama-13b:4-layers"
    assert (cut.hidden, cut.n_heads, cut.ffn, cut.vocab) == (full.hidden, full.n_heads,
                                                             full.ffn, full.vocab)


@pytest.mark.parametrize("name", ["llama-13b:0-layers", "llama-13b:41-layers"])
def test_layer_slice_out_of_range_is_refused(name):
    with pytest.raises(SpecError, match="has 40 layers; slice 1..40"):
        load_model(name)


@pytest.mark.parametrize("given", ["x" * 5000, "{tmp}/" + "y" * 300 + ".yaml",
                                   "{tmp}/" + "z" * 300 + ".json", "a\0b"])
@pytest.mark.parametrize("loader", ["model", "gpu", "cluster"])
def test_a_name_the_os_will_not_look_up_is_one_line(tmp_path, given, loader):
    given = given.format(tmp=tmp_path)
    read = {"model": load_model, "gpu": lambda n: load(GPUSpec, n),
            "cluster": lambda n: load(ClusterSpec, n)}[loader]
    with pytest.raises(PresetNotFound) as err:
        read(given)
    message = str(err.value)
    assert "\n" not in message and len(message) < 300
    assert quote(given)[:20] in message
