"""transformers' Trainer as the outside baseline (`harness.hf_trainer`), on CPU.

What makes its figure comparable is checked here: it starts from the control's weights
(`hf_baseline`) and learns the harness's targets (the label shift), Trainer gets the
settings the module promises at each layout, a run writes the harness's record with
`impl: hf-trainer` and nothing else on stdout, DDP really runs on two gloo ranks, and
what it cannot run is one line and exit 2. FSDP2 through accelerate needs GPUs (on CPU
accelerate falls back to DDP, so it is refused there); its GPU launches are the record.
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
pytest.importorskip("accelerate")

from trainplan.bench.harness import hf_baseline, hf_trainer, train  # noqa: E402
from trainplan.bench.harness.step import cross_entropy  # noqa: E402
from trainplan.bench.series import run as series_run  # noqa: E402
from trainplan.bench.series import sidebyside, suite  # noqa: E402
from trainplan.errors import SpecError  # noqa: E402
from trainplan.specs import ModelSpec, ParallelConfig, load_model  # noqa: E402

TINY = ModelSpec(name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=512)
TINY_YAML = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 512\n"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hft") / "tiny.yaml"
    path.write_text(TINY_YAML)
    return str(path)


def test_starts_from_the_controls_weights():
    """Same seed, same weights as the in-loop baseline's build: the two differ only in loop."""
    ours = hf_trainer.build_model(TINY, 32, seed=3)
    torch.manual_seed(3)
    control = hf_baseline.HFCausalLM(TINY, 32)
    control.init_weights()
    theirs = control.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, theirs[f"hf.{name}"], rtol=0, atol=0)


def test_label_shift_gives_the_harness_targets():
    """Trainer's loss on a Rows item equals our loss on the same targets (the last dropped),
    masked positions included."""
    model = hf_trainer.build_model(TINY, 16, seed=0)
    x = torch.randint(TINY.vocab, (16,))
    y = torch.randint(TINY.vocab, (16,))
    y[:5] = -100  # a masked prompt, as instruction data has

    class One(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return x, y

    item = hf_trainer.Rows(One())[0]
    assert item["input_ids"].equal(x) and item["labels"][0] == -100
    theirs = model(input_ids=x[None], labels=item["labels"][None]).loss
    logits = model(input_ids=x[None]).logits
    ours = cross_entropy(logits[:, :-1], y[None, :-1])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def _args(*extra):
    return train.parse_args(["--model", "llama-1.3b", "--steps", "9", "--warmup", "2", *extra])


@pytest.mark.parametrize("flags, want", [
    ((), {"fsdp": False, "torch_compile": False, "gradient_checkpointing": False}),
    (("--dp", "2", "--zero", "2", "--compile"),
     {"fsdp": True, "reshard_after_forward": False, "torch_compile": True}),
    (("--dp", "2", "--zero", "3", "--recompute", "full"),
     {"fsdp": True, "reshard_after_forward": True, "gradient_checkpointing": True}),
    (("--dp", "2"), {"fsdp": False, "ddp_find_unused_parameters": False}),
])
def test_trainer_gets_the_layouts_settings(flags, want):
    args = _args(*flags, "--micro-batch", "6", "--grad-accum", "2", "--num-workers", "3",
                 "--pin-memory")
    kw = hf_trainer.trainer_arguments(args, train.layout(args), "/tmp/x", cuda=True)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"],
            kw["max_steps"], kw["dataloader_num_workers"], kw["bf16"]) == (6, 2, 9, 3, True)
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["weight_decay"], kw["max_grad_norm"]) == (
        0.9, 0.95, 0.1, 1.0)
    assert kw["logging_strategy"] == kw["save_strategy"] == "no"
    got = {**kw, "fsdp": bool(kw.get("fsdp")), **(kw.get("fsdp_config") or {})}
    assert {k: got.get(k) for k in want} == want
    if want["fsdp"]:
        assert kw["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    import transformers  # the arguments are valid TrainingArguments on this install

    transformers.TrainingArguments(**{**kw, "bf16": False, "use_cpu": True,
                                      "fsdp": False, "fsdp_config": None})


@pytest.mark.parametrize("flags, word", [
    (("--zero", "1", "--dp", "1"), "ZeRO-1"),
    (("--recompute", "selective"), "selective"),
    (("--ckpt-dir", "x"), "--ckpt-dir"),
    (("--impl", "hf-baseline"), "leave --impl out"),
    (("--tp", "2"), "tp = 2"),
    (("--loss", "fused"), "fused"),
    (("--data", "instruct"), "--data instruct"),
])
def test_what_it_cannot_run_is_one_line_and_exit_2(flags, word, tiny, capsys):
    argv = ["--model", tiny, "--seq-len", "16", "--steps", "3", "--warmup", "1", "--cpu", *flags]
    assert hf_trainer.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error:"), err
    assert word in err, err


def test_one_run_writes_the_harness_record(tiny, tmp_path, capsys):
    rec = tmp_path / "m.jsonl"
    argv = ["--model", tiny, "--seq-len", "32", "--micro-batch", "4", "--steps", "6",
            "--warmup", "2", "--num-workers", "0", "--lr", "3e-3", "--cpu", "--records",
            str(rec), "--peak-tflops", "1", "--run-id", "r1", "--tag", "t1"]
    threads = torch.get_num_threads()
    try:
        assert hf_trainer.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1  # Trainer's own log lines kept off stdout: one JSON summary
    summary = json.loads(lines[0])
    (record,) = [json.loads(ln) for ln in rec.read_text().splitlines()]
    assert record["impl"] == summary["impl"] == "hf-trainer"
    assert (record["run_id"], record["tag"]) == ("r1", "t1")
    assert len(summary["step_times_s"]) == 4 and summary["warmup_steps_dropped"] == 2
    assert all(t > 0 for t in summary["step_times_s"])
    assert len(summary["losses"]) == 6 and summary["losses"][-1] < summary["losses"][0]
    assert any("Trainer" in n for n in summary["notes"])
    assert summary["tokens_per_step"] == 4 * 32 and summary["setup_s"] > 0


def test_compile_scope_reads_the_module_tree():
    model = hf_trainer.build_model(TINY, 16, seed=0)
    assert hf_trainer.compile_scope(model) == "none"
    assert hf_trainer.compile_scope(torch.compile(model)) == "whole model"
    model.model.layers[0] = torch.compile(model.model.layers[0])
    assert hf_trainer.compile_scope(model) == "regions"


def test_compile_scope_sees_modules_compiled_in_place():
    """accelerate compiles FSDP2's regions with `module.compile()`: the class stays."""
    model = hf_trainer.build_model(TINY, 16, seed=0)
    model.model.layers[1].compile()
    assert hf_trainer.compile_scope(model) == "regions"
    model.compile()
    assert hf_trainer.compile_scope(model) == "whole model"


@pytest.mark.parametrize("switch, scope", [(None, "regions"), ("0", "whole model")])
def test_compile_is_regional_unless_accelerate_is_told(switch, scope, tiny, monkeypatch,
                                                       capsys):
    """--compile runs accelerate's regional compilation by default (the whole-model compile
    materialises the causal mask); accelerate's own switch set to 0 gives the whole model.
    Dynamo's eager backend: the tracing is real, no C++ toolchain needed."""
    monkeypatch.setenv(hf_trainer.REGIONAL, switch or "")  # restored after the test, and
    if switch is None:  # so is the value the run sets where it was unset
        monkeypatch.delenv(hf_trainer.REGIONAL)
    real = hf_trainer.trainer_arguments
    monkeypatch.setattr(hf_trainer, "trainer_arguments",
                        lambda *a, **kw: {**real(*a, **kw), "torch_compile_backend": "eager"})
    argv = ["--model", tiny, "--seq-len", "16", "--micro-batch", "2", "--steps", "3",
            "--warmup", "1", "--num-workers", "0", "--cpu", "--compile", "--json"]
    threads = torch.get_num_threads()
    try:
        assert hf_trainer.main(argv) == 0, capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert f"compiled: {scope}" in summary["notes"]


def test_two_gloo_ranks_run_ddp_compiled_by_regions(tiny):
    """accelerate wraps DDP first and compiles after: its regional compilation reaches the
    decoder layers inside DDP (dynamo's eager backend: `eager_trainer.py`)."""
    env = {k: v for k, v in os.environ.items() if k != hf_trainer.REGIONAL}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(Path(__file__).with_name(
                               "eager_trainer.py")),
                           "--model", tiny, "--seq-len", "32", "--micro-batch", "2", "--dp",
                           "2", "--steps", "4", "--warmup", "1", "--num-workers", "0", "--cpu",
                           "--compile", "--json"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert got["ranks"] == 2 and got["tokens_per_step"] == 2 * 2 * 32
    assert {"wrapped as DistributedDataParallel", "compiled: regions"} <= set(got["notes"])


def test_suite_launches_trainer_configs_in_their_own_module():
    loaded = suite.load_suite(str(ROOT / "data/suites/baseline-1gpu.yaml"))
    assert sum(c.get("naive", False) for c in loaded["configs"]) == 1
    impls = set()
    for c in loaded["configs"]:
        cmd = suite.train_command(loaded, c, Path("/tmp/x"), "run")
        module = cmd[cmd.index("-m", 3) + 1]
        impl = c.get("impl", "trainplan")
        impls.add(impl)
        assert module == ("trainplan.bench.harness.hf_trainer" if impl == "hf-trainer"
                          else "trainplan.bench.harness.train")
        assert ("--impl" in cmd) == (impl == "hf-baseline")
        if impl == "hf-trainer":
            hf_trainer.check(_args(), load_model(loaded["model"]),
                             ParallelConfig(**suite.full_layout(c)), world=c["gpus"])
    assert impls == {"trainplan", "hf-baseline", "hf-trainer"}


def test_a_sweep_refuses_trainer_configs_before_predicting(tmp_path):
    path = ROOT / "data/suites/baseline-1gpu.yaml"
    with pytest.raises(SpecError, match="leave out --sweep"):
        series_run.run_suite(str(path), tmp_path / "out", 1, ["hft-1gpu-mb8"], 10.0, sweep=True)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_sidebyside_names_each_kind_of_baseline():
    def done(step_s):  # one launch: 10 steps of 1000 tokens at step_s seconds each
        return [{"tokens_per_step": 1000, "ranks": 1, "step_times_s": [step_s] * 10,
                 "flops_per_token": 1e9, "peak_tflops": 1.0, "peak_mem_reserved_gib": 1.0}]
    configs = [{"tag": "ours", "gpus": 1}, {"tag": "loop", "gpus": 1, "impl": "hf-baseline"},
               {"tag": "trainer", "gpus": 1, "impl": "hf-trainer"},
               {"tag": "naive", "gpus": 1, "impl": "hf-trainer", "naive": True}]
    rows = [("ours", None, done(0.5)), ("loop", None, done(0.51)),
            ("trainer", None, done(0.6)), ("naive", None, done(0.8))]
    out = sidebyside.compare(configs, rows)
    assert (out["best_baseline"], out["best_baseline_impl"]) == ("loop", "hf-baseline")
    assert out["speedup_vs_best_baseline"] == pytest.approx(1.02)
    assert out["by_baseline"]["hf-trainer"]["best"] == "trainer"
    assert out["by_baseline"]["hf-trainer"]["speedup"] == pytest.approx(1.2)
    assert out["speedup_vs_naive"] == pytest.approx(1.6)
    text = sidebyside.format_comparison(out)
    assert "1.020x" in text and "transformers Trainer trainer: 1.200x" in text
