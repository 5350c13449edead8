"""The command-line contract (README, "Command line"), through a real subprocess, as a user
runs it."""

from __future__ import annotations

import json
import subprocess
import time
import warnings

import pytest

from conftest import trainplan_cli
from trainplan.cli import main

PLAN_KEYS = {"parallel", "memory_gib", "fits", "step_time_s", "tokens_per_s",
             "tokens_per_s_per_gpu", "mfu"}
PARALLEL_KEYS = {"dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "recompute"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "other", "total"}
BASE = ["--model", "llama-13b", "--gpu", "h100-sxm"]
PLAN13 = ["plan", *BASE, "--gpus", "32"]

GPT_YAML = """\
# a GPT-style model: 4h GELU MLP, multi-head attention, learned positions
n_layers: 12
hidden: 768
n_heads: 12
ffn: 3072
vocab: 50257
mlp: gelu
positions: learned
max_positions: 1024
norm: layernorm
bias: true
tied_embeddings: true
"""
SMALL_YAML = "n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 256\nvocab: 100\n"


def _ok(args, cwd):
    r = trainplan_cli(args, cwd)
    assert r.returncode == 0, r.stderr
    return r


def _json(args, cwd):
    r = _ok([*args, "--json"], cwd)
    return json.loads(r.stdout)


def _check_plan(p):
    assert PLAN_KEYS <= set(p)
    assert PARALLEL_KEYS <= set(p["parallel"])
    assert set(p["memory_gib"]) == MEMORY_KEYS
    assert all(isinstance(p["parallel"][k], int) for k in PARALLEL_KEYS - {"recompute"})
    assert p["parallel"]["recompute"] in ("none", "selective", "full")
    assert isinstance(p["fits"], bool)
    for k in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu"):
        assert isinstance(p[k], float) and p[k] > 0, k
    mem = p["memory_gib"]
    parts = sum(mem[k] for k in MEMORY_KEYS - {"total"})
    assert parts == pytest.approx(mem["total"], abs=0.01)


# ---------------------------------------------------------------- plan


def test_plan_13b_on_32_h100_json_contract_and_speed(tmp_path):
    start = time.perf_counter()
    r = trainplan_cli([*PLAN13, "--json"], tmp_path)
    wall = time.perf_counter() - start
    print(f"\ntrainplan plan --model llama-13b --gpu h100-sxm --gpus 32 --json: {wall:.2f} s wall")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ("trainplan: --cluster dgx-h100 (the cluster of --gpu h100-sxm; pass "
                        "--cluster to choose another)\n")  # the default said, JSON stays valid
    out = json.loads(r.stdout)
    assert r.stdout.count("\n") <= 1  # one JSON object
    assert {"plans", "searched", "elapsed_s"} <= set(out)
    assert isinstance(out["searched"], int) and out["searched"] > 1000
    assert isinstance(out["elapsed_s"], float) and out["elapsed_s"] < wall
    plans = out["plans"]
    assert len(plans) == 5  # default --top
    for p in plans:
        _check_plan(p)
        assert p["fits"] is True
        par = p["parallel"]
        assert par["dp"] * par["tp"] * par["pp"] * par["cp"] == 32
        assert par["dp"] * par["micro_batch"] * par["grad_accum"] * 4096 == 4 * 2**20
        assert p["memory_gib"]["total"] <= 79.6
        assert p["tokens_per_s_per_gpu"] == pytest.approx(p["tokens_per_s"] / 32)
    speeds = [p["tokens_per_s"] for p in plans]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(speeds, speeds[1:], strict=False))
    # its speed is `make bench-search`'s to print, not a bound here: under load it flakes


def test_plan_top_and_options(tmp_path):
    out = _json([*PLAN13, "--top", "2", "--seq-len", "2048", "--global-batch-tokens", "2097152",
                 "--cluster", "dgx-a100", "--gpus-per-node", "8"], tmp_path)
    assert len(out["plans"]) == 2
    for p in out["plans"]:
        par = p["parallel"]
        assert par["dp"] * par["micro_batch"] * par["grad_accum"] * 2048 == 2097152


def test_plan_pins_are_honoured(tmp_path):
    out = _json([*PLAN13, "--tp", "8", "--zero", "1", "--recompute", "selective"], tmp_path)
    assert out["plans"]
    for p in out["plans"]:
        assert (p["parallel"]["tp"], p["parallel"]["zero"], p["parallel"]["recompute"]) == (
            8, 1, "selective")


def test_plan_fully_pinned_not_fitting_is_still_answered(tmp_path):
    out = _json(["plan", "--model", "llama-70b", "--gpu", "h100-sxm", "--gpus", "8",
                 "--dp", "8", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "0",
                 "--micro-batch", "1", "--recompute", "none",
                 "--global-batch-tokens", "1048576"], tmp_path)
    assert len(out["plans"]) == 1
    p = out["plans"][0]
    _check_plan(p)
    assert p["fits"] is False and p["memory_gib"]["total"] > 1000
    assert p["parallel"]["grad_accum"] == 32


def test_plan_with_every_contract_flag_pinned_evaluates_one_layout(tmp_path):
    flags = ["--dp", "16", "--tp", "1", "--pp", "1", "--cp", "1", "--ep", "1", "--zero", "3",
             "--micro-batch", "1", "--grad-accum", "64", "--recompute", "none",
             "--pp-schedule", "1f1b", "--pp-virtual", "1"]
    out = _json(["plan", *BASE, "--gpus", "16", *flags], tmp_path)
    mem = _json(["memory", *BASE, *flags], tmp_path)
    assert out["searched"] == 1
    assert out["plans"][0]["memory_gib"] == mem["memory_gib"]


def test_plan_human_output(tmp_path):
    r = _ok(PLAN13, tmp_path)
    lines = r.stdout.strip().splitlines()
    assert "llama-13b" in lines[0] and "32" in lines[0] and "layouts" in lines[0]
    assert "strategy" in lines[1] and "MFU" in lines[1]
    rows = lines[2:2 + 5]
    assert all(line[:2].strip().isdigit() and "yes" in line for line in rows)
    # after the five plans: notes on plans the trainer cannot run yet, then the decision
    rest = lines[2 + 5:]
    heads = ("not runnable yet: ", "band: ", "decision: #", "  passed over: #",
             "  no plan fits")
    assert all(line.startswith(heads) for line in rest)
    assert sum(line.startswith("decision: #") for line in rest) == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.stdout)


def test_plan_gpt_style_yaml_model(tmp_path):
    model = tmp_path / "gpt-small.yaml"
    model.write_text(GPT_YAML)
    out = _json(["plan", "--model", str(model), "--gpu", "a100-80gb", "--gpus", "8",
                 "--seq-len", "1024", "--global-batch-tokens", "524288"], tmp_path)
    assert out["plans"] and all(p["fits"] for p in out["plans"])
    for p in out["plans"]:
        _check_plan(p)
        assert 12 % p["parallel"]["tp"] == 0


def test_yaml_gpu_and_cluster_files_work(tmp_path):
    gpu = tmp_path / "my-gpu.yaml"
    gpu.write_text("bf16_tflops: 500\nmemory_gib: 40\nhbm_tbps: 2.0\nmatmul_efficiency: 0.7\n"
                   "attention_efficiency: 0.4\nmemory_efficiency: 0.8\n")
    cluster = tmp_path / "my-net.yaml"
    cluster.write_text("gpus_per_node: 4\nintra_node_gbps: 200\ninter_node_gbps: 25\n"
                       "intra_node_latency_us: 20\ninter_node_latency_us: 40\n"
                       "intra_node_efficiency: 0.8\ninter_node_efficiency: 0.8\n")
    out = _json(["plan", "--model", "llama-1.3b", "--gpu", str(gpu), "--cluster", str(cluster),
                 "--gpus", "8", "--top", "3"], tmp_path)
    assert all(p["parallel"]["tp"] <= 4 for p in out["plans"])
    assert all(p["memory_gib"]["total"] <= 40 for p in out["plans"])


# ---------------------------------------------------------------- memory


def test_memory_json_contract(tmp_path):
    out = _json(["memory", *BASE, "--tp", "8", "--recompute", "selective"], tmp_path)
    assert {"memory_gib", "fits"} <= set(out)
    assert set(out["memory_gib"]) == MEMORY_KEYS
    assert out["fits"] is True
    # 13B over tp 8, one data-parallel rank (autocast): fp32 weights, 4 bytes x ~1.63 G
    # params, and Adam's two fp32 moments, twice that
    assert out["memory_gib"]["params"] == pytest.approx(6.06, abs=0.01)
    assert out["memory_gib"]["optimizer"] == pytest.approx(2 * out["memory_gib"]["params"],
                                                           rel=1e-3)


def test_memory_not_fitting(tmp_path):
    out = _json(["memory", "--model", "llama-70b", "--gpu", "h100-sxm"], tmp_path)
    assert out["fits"] is False and out["memory_gib"]["total"] > 1000


def test_memory_zero3_shards(tmp_path):
    ddp = _json(["memory", *BASE, "--dp", "8"], tmp_path)["memory_gib"]
    fsdp = _json(["memory", *BASE, "--dp", "8", "--zero", "3"], tmp_path)["memory_gib"]
    for k in ("params", "grads", "optimizer"):
        assert fsdp[k] == pytest.approx(ddp[k] / 8, abs=2e-3)


def test_memory_human_output(tmp_path):
    r = _ok(["memory", *BASE, "--tp", "8"], tmp_path)
    assert "llama-13b" in r.stdout and "total" in r.stdout and "fits: yes" in r.stdout
    assert "GiB" in r.stdout


def test_version_and_help(tmp_path):
    r = _ok(["--version"], tmp_path)
    assert r.stdout.startswith("trainplan ")
    r = _ok(["plan", "--help"], tmp_path)
    assert "--global-batch-tokens" in r.stdout and "--pp-schedule" in r.stdout


# ---------------------------------------------------------------- bad input

BAD_FILES = {
    "malformed.yaml": "n_layers: [1\n",
    "list.yaml": "- 1\n- 2\n",
    "empty.yaml": "",
    "missing.yaml": "n_layers: 2\nhidden: 64\n",
    "unknown.yaml": SMALL_YAML + "colour: blue\n",
    "wrongtype.yaml": SMALL_YAML.replace("n_layers: 2", "n_layers: two"),
    "negative.yaml": SMALL_YAML.replace("n_layers: 2", "n_layers: -2"),
    "zero.yaml": SMALL_YAML.replace("hidden: 64", "hidden: 0"),
    "indivisible.yaml": SMALL_YAML.replace("hidden: 64", "hidden: 65"),
    "kvheads.yaml": SMALL_YAML + "n_kv_heads: 3\n",
    "badmlp.yaml": SMALL_YAML + "mlp: relu\n",
    "float-layers.yaml": SMALL_YAML.replace("n_layers: 2", "n_layers: 2.5"),
    "badgpu.yaml": "bf16_tflops: 100\nmemory_gib: 80\nhbm_tbps: 1\nmatmul_efficiency: 1.5\n"
                   "attention_efficiency: 0.4\nmemory_efficiency: 0.9\n",
    "nangpu.yaml": "bf16_tflops: .nan\nmemory_gib: 80\nhbm_tbps: 1\nmatmul_efficiency: 0.5\n"
                   "attention_efficiency: 0.5\nmemory_efficiency: 0.5\n",
    "infgpu.yaml": "bf16_tflops: 989\nmemory_gib: .inf\nhbm_tbps: 1\nmatmul_efficiency: 0.5\n"
                   "attention_efficiency: 0.5\nmemory_efficiency: 0.5\n",
    "badcluster.yaml": "gpus_per_node: 0\nintra_node_gbps: 1\ninter_node_gbps: 1\n"
                       "intra_node_latency_us: 1\ninter_node_latency_us: 1\n"
                       "intra_node_efficiency: 1\ninter_node_efficiency: 1\n",
}
G8 = ["--gpu", "h100-sxm", "--gpus", "8"]

# (id, argv with {d} for the input folder, a fragment of stderr that names the bad value)
BAD_INPUTS = [
    ("plan-recipe-in-bf16", ["plan", "--model", "llama-7b", *G8, "--fp8-recipe", "rowwise"],
     "--fp8-recipe rowwise"),
    ("validate-two-calibrations", ["validate", "--suite", "data/suites/baseline-1gpu.yaml",
                                   "--out", "{d}/v", "--gpus", "1", "--skip-micro",
                                   "--calibration", "c.yaml"],
     "name two calibrations"),
    ("calibrate-out-folder", ["calibrate", "--gpu", "h100-sxm", "--committed", "--out", "{d}"],
     "is a folder"),
    ("unknown-model", ["plan", "--model", "llama-9000b", *G8], "'llama-9000b'"),
    ("unknown-gpu", ["plan", "--model", "llama-7b", "--gpu", "b200", "--gpus", "8"], "'b200'"),
    ("unknown-cluster", ["plan", "--model", "llama-7b", *G8, "--cluster", "dgx-z"], "'dgx-z'"),
    ("malformed-yaml", ["plan", "--model", "{d}/malformed.yaml", *G8], "malformed.yaml"),
    ("yaml-is-a-list", ["plan", "--model", "{d}/list.yaml", *G8], "expected a mapping"),
    ("yaml-empty", ["plan", "--model", "{d}/empty.yaml", *G8], "empty.yaml"),
    ("yaml-missing-field", ["plan", "--model", "{d}/missing.yaml", *G8], "'ffn'"),
    ("yaml-unknown-field", ["plan", "--model", "{d}/unknown.yaml", *G8], "'colour'"),
    ("yaml-wrong-type", ["plan", "--model", "{d}/wrongtype.yaml", *G8], "'two'"),
    ("yaml-negative", ["plan", "--model", "{d}/negative.yaml", *G8], "n_layers = -2"),
    ("yaml-zero", ["plan", "--model", "{d}/zero.yaml", *G8], "hidden = 0"),
    ("yaml-float-int", ["plan", "--model", "{d}/float-layers.yaml", *G8], "2.5"),
    ("hidden-not-divisible", ["plan", "--model", "{d}/indivisible.yaml", *G8], "65"),
    ("kv-heads-not-dividing", ["plan", "--model", "{d}/kvheads.yaml", *G8], "n_kv_heads = 3"),
    ("yaml-bad-choice", ["plan", "--model", "{d}/badmlp.yaml", *G8], "'relu'"),
    ("gpu-yaml-efficiency", ["plan", "--model", "llama-7b", "--gpu", "{d}/badgpu.yaml",
                             "--gpus", "8"], "matmul_efficiency = 1.5"),
    ("gpu-yaml-nan", ["plan", "--model", "llama-7b", "--gpu", "{d}/nangpu.yaml", "--gpus", "8"],
     "bf16_tflops = nan"),
    ("gpu-yaml-inf", ["memory", "--model", "llama-7b", "--gpu", "{d}/infgpu.yaml"],
     "memory_gib = inf"),
    ("cluster-yaml-zero", ["plan", "--model", "llama-7b", *G8, "--cluster",
                           "{d}/badcluster.yaml"], "gpus_per_node = 0"),
    ("yaml-does-not-exist", ["plan", "--model", "{d}/absent.yaml", *G8], "absent.yaml"),
    ("yaml-is-a-directory", ["plan", "--model", "{d}/folder.yaml", *G8], "folder.yaml"),
    ("yaml-binary-garbage", ["plan", "--model", "{d}/garbage.yaml", *G8], "garbage.yaml"),
    ("tp-not-dividing-heads", [*PLAN13, "--tp", "3"], "--tp 3"),
    ("tp-beyond-node", [*PLAN13, "--tp", "16"], "--tp 16"),
    ("pp-not-dividing-layers", [*PLAN13, "--pp", "3"], "--pp 3"),
    ("cp-not-splitting-seq", [*PLAN13, "--cp", "3"], "--cp 3"),
    ("dp-not-dividing-gpus", [*PLAN13, "--dp", "5"], "--dp 5"),
    ("ep-on-dense-model", [*PLAN13, "--ep", "2"], "--ep 2"),
    ("gpus-not-whole-nodes", ["plan", *BASE, "--gpus", "12"], "--gpus 12"),
    ("gpus-zero", ["plan", *BASE, "--gpus", "0"], "'0'"),
    ("gpus-negative", ["plan", *BASE, "--gpus", "-8"], "'-8'"),
    ("gpus-non-numeric", ["plan", *BASE, "--gpus", "eight"], "'eight'"),
    ("gpus-fractional", ["plan", *BASE, "--gpus", "8.5"], "'8.5'"),
    ("gpus-per-node-zero", [*PLAN13, "--gpus-per-node", "0"], "--gpus-per-node"),
    ("batch-not-whole-sequences", [*PLAN13, "--global-batch-tokens", "1000"], "1000"),
    ("batch-unreachable", ["plan", *BASE, "--gpus", "16", "--global-batch-tokens", "4096",
                           "--cp", "1", "--pp", "1"], "4096"),
    ("micro-batch-unreachable", [*PLAN13, "--micro-batch", "3"], "'micro_batch': 3"),
    ("nothing-fits", ["plan", "--model", "llama-70b", "--gpu", "h100-sxm", "--gpus", "1"],
     "llama-70b"),
    ("unknown-flag", [*PLAN13, "--bogus"], "--bogus"),
    ("missing-required-flag", ["plan", *BASE], "--gpus"),
    ("missing-verb", [], "verb"),
    ("unknown-verb", ["fly"], "'fly'"),
    ("zero-out-of-range", [*PLAN13, "--zero", "4"], "invalid choice: 4"),
    ("zero-not-a-number", [*PLAN13, "--zero", "x"], "'x'"),
    ("recompute-bad-choice", [*PLAN13, "--recompute", "some"], "'some'"),
    ("pp-schedule-bad-choice", [*PLAN13, "--pp-schedule", "zigzag"], "'zigzag'"),
    ("seq-len-zero", [*PLAN13, "--seq-len", "0"], "'0'"),
    ("seq-len-non-numeric", [*PLAN13, "--seq-len", "long"], "'long'"),
    ("top-zero", [*PLAN13, "--top", "0"], "'0'"),
    ("memory-unknown-gpu", ["memory", "--model", "llama-7b", "--gpu", "v100"], "'v100'"),
    ("memory-dp-shard-not-dividing", ["memory", *BASE, "--dp", "4", "--zero", "3",
                                      "--dp-shard", "3"], "dp_shard = 3"),
    ("memory-ddp-cannot-shard", ["memory", *BASE, "--dp", "4", "--dp-shard", "2"],
     "dp_shard > 1 needs zero"),
    ("memory-virtual-without-interleaved", ["memory", *BASE, "--pp", "2", "--pp-virtual", "2"],
     "pp_virtual"),
    ("memory-tp-beyond-node", ["memory", *BASE, "--tp", "16"], "--tp 16"),
    ("memory-micro-batch-negative", ["memory", *BASE, "--micro-batch", "-1"], "'-1'"),
    ("memory-gpus-flag-not-taken", ["memory", *BASE, "--gpus", "8"], "--gpus"),
]


@pytest.fixture
def bad_inputs_dir(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for name, text in BAD_FILES.items():
        (d / name).write_text(text)
    (d / "folder.yaml").mkdir()
    (d / "garbage.yaml").write_bytes(bytes(range(128, 256)) * 8 + b"\x00\xff" * 64)
    return d


def assert_clean_refusal(r, cwd, fragment):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.endswith("\n") and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("trainplan: error: ")
    assert fragment in r.stderr, r.stderr
    assert list(cwd.iterdir()) == []  # nothing written


# the kinds of bad input the README names run as real subprocesses; the rest run
# in-process through `cli.main` (same code path, milliseconds instead of a pandas import each)
SUBPROCESS_CASES = {
    "unknown-model", "unknown-gpu", "unknown-cluster", "malformed-yaml", "yaml-is-a-list",
    "yaml-missing-field", "yaml-unknown-field", "yaml-wrong-type", "yaml-negative", "yaml-zero",
    "hidden-not-divisible", "tp-not-dividing-heads", "pp-not-dividing-layers",
    "gpus-not-whole-nodes", "gpus-zero", "gpus-negative", "gpus-non-numeric",
    "batch-not-whole-sequences", "batch-unreachable", "nothing-fits", "unknown-flag",
    "missing-required-flag", "zero-out-of-range", "recompute-bad-choice",
    "pp-schedule-bad-choice", "seq-len-zero", "yaml-does-not-exist", "yaml-is-a-directory",
    "yaml-binary-garbage", "memory-unknown-gpu",
}


def _argv(argv, d, as_json):
    argv = [a.format(d=d) for a in argv]
    return argv + (["--json"] if as_json and argv and argv[0] in ("plan", "memory") else [])


def test_bad_input_case_lists():
    ids = [c[0] for c in BAD_INPUTS]
    assert len(set(ids)) == len(ids) >= 50
    assert SUBPROCESS_CASES <= set(ids) and len(SUBPROCESS_CASES) >= 25


@pytest.mark.parametrize(("argv", "fragment", "as_json"),
                         [(*c[1:], i % 2 == 0) for i, c in enumerate(BAD_INPUTS)
                          if c[0] in SUBPROCESS_CASES],
                         ids=[c[0] for c in BAD_INPUTS if c[0] in SUBPROCESS_CASES])
def test_bad_input_exit_2_one_line_nothing_written(tmp_path, bad_inputs_dir, argv, fragment,
                                                   as_json):
    """A real process: exit 2, one line on stderr, empty stdout, no file in the cwd.

    Every other case runs with --json: the refusal is the same in both modes.
    """
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = trainplan_cli(_argv(argv, bad_inputs_dir, as_json), cwd)
    assert_clean_refusal(r, cwd, fragment)


@pytest.mark.parametrize(("argv", "fragment", "as_json"),
                         [(*c[1:], i % 2 == 0) for i, c in enumerate(BAD_INPUTS)
                          if c[0] not in SUBPROCESS_CASES],
                         ids=[c[0] for c in BAD_INPUTS if c[0] not in SUBPROCESS_CASES])
def test_bad_input_in_process(tmp_path, bad_inputs_dir, monkeypatch, capsys, argv, fragment,
                              as_json):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy RuntimeWarning would be a bug here
        rc = main(_argv(argv, bad_inputs_dir, as_json))
    out, err = capsys.readouterr()
    assert_clean_refusal(subprocess.CompletedProcess([], rc, out, err), cwd, fragment)


# ---------------------------------------------------------------- bugs found and fixed

FIXED_BAD_INPUTS = [
    pytest.param(["plan", "--model", "{d}/mixkeys.yaml", *G8], "unknown field",
                 id="yaml-mixed-key-types"),
    pytest.param([*PLAN13, "--dp-shard", "3"], "--dp-shard 3", id="dp-shard-not-dividing"),
    pytest.param(["plan", *BASE, "--gpus", "1e9"], "--gpus",
                 id="gpus-huge"),
    pytest.param(["plan", "--model", "{d}/folder.yaml", *G8], "directory",
                 id="yaml-directory-message"),
    pytest.param(["memory", *BASE, "--tp", "3"], "[1, 2, 4, 8]",
                 id="memory-tp-valid-values"),
    pytest.param(["memory", *BASE, "--pp", "8", "--pp-schedule", "interleaved",
                  "--pp-virtual", "4"], "pp",
                 id="memory-virtual-stages-not-dividing-layers"),
    pytest.param(["plan", "--model", "{d}/hugehidden.yaml", *G8], "hidden",
                 id="yaml-huge-integer"),
    pytest.param([*PLAN13, "--global-batch-tokens", "1e30"], "--global-batch-tokens",
                 id="batch-tokens-beyond-int64"),
    pytest.param([*PLAN13, "--global-batch-tokens", str(2**63)], "--global-batch-tokens",
                 id="batch-tokens-int64-wraps"),
    pytest.param([*PLAN13, "--pp-virtual", "3"], "--pp-virtual", id="pp-virtual-message"),
    pytest.param(["memory", "--model", "gpt2-xl", "--gpu", "h100-sxm", "--seq-len", "8192"],
                 "--seq-len 8192 is longer than model 'gpt2-xl' has learned positions for "
                 "(max_positions 1024)",
                 id="memory-seq-len-beyond-learned-positions"),
    pytest.param(["plan", "--model", "gpt2-xl", *G8, "--seq-len", "8192"],
                 "--seq-len 8192 is longer than model 'gpt2-xl' has learned positions for "
                 "(max_positions 1024)",
                 id="plan-seq-len-beyond-learned-positions"),
    pytest.param(["plan", "--model", "llama-7b", *G8, "--tp", "4", "--pp", "4"],
                 "the pins --tp 4 x --pp 4 need 16 GPUs, and 16 does not divide --gpus 8",
                 id="plan-pins-product-beyond-gpus"),
]


@pytest.mark.parametrize(("argv", "fragment"), FIXED_BAD_INPUTS)
def test_bad_input_regressions(tmp_path, bad_inputs_dir, argv, fragment):
    (bad_inputs_dir / "mixkeys.yaml").write_text(
        "{n_layers: 2, hidden: 64, n_heads: 4, ffn: 256, vocab: 100, 1: 2, foo: 3}\n")
    (bad_inputs_dir / "hugehidden.yaml").write_text(
        f"n_layers: 2\nhidden: {2**65}\nn_heads: 1\nffn: 4\nvocab: 100\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    argv = [a.format(d=bad_inputs_dir) for a in argv]
    # bounded: a refusal takes about a second; the margin is for a machine shared with
    # other test workers, not a speed target (tools/ benchmarks print those)
    r = trainplan_cli([*argv, "--json"], cwd, timeout=15)
    assert_clean_refusal(r, cwd, fragment)
