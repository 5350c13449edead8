"""`--loss fused` in the harness on CPU: the same loss curve and gradient norms as the
standard loss (synthetic tokens, and instruction rows whose prompts and padding carry no
loss), the refusal of layouts it is not built for, and the field in records and suites."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from trainplan.bench.harness import data, train
from trainplan.bench.series import suite
from trainplan.compare.matching import same_config
from trainplan.data import instruct
from trainplan.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5  # observed: ~1e-7 (fp32; the chunked sums differ only in order)
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 320\n"
BASE = ["--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--steps", "4",
        "--warmup", "1", "--lr", "3e-3", "--seed", "0", "--cpu", "--json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fused") / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def _run(tiny: str, *flags: str) -> dict:
    return train.run(train.parse_args(["--model", tiny, *BASE, *flags]))


def _assert_same_curve(fused: dict, standard: dict) -> None:
    for key in ("losses", "grad_norms"):
        assert fused[key] == pytest.approx(standard[key], rel=RTOL), key
    assert standard["losses"][-1] < standard["losses"][0], "the loss should fall"
    assert fused["layout"]["loss"] == "fused" and standard["layout"]["loss"] == "standard"


def test_fused_loss_trains_as_the_standard_loss(tiny):
    """Chunk 24 does not divide the 64 tokens of a micro-batch: an uneven last chunk."""
    _assert_same_curve(_run(tiny, "--synthetic", "--loss", "fused", "--loss-chunk", "24"),
                       _run(tiny, "--synthetic"))


def test_fused_loss_on_instruction_rows_with_masked_labels(shared_cache, tiny, tmp_path):
    """Padded instruction rows: prompts and padding are -100, so chunks hold few or no
    positions with a loss; the mean over the rest must equal F.cross_entropy's."""
    recs = instruct.stdlib_records(0, root=Path(sysconfig.get_paths()["stdlib"]) / "json")
    path = instruct.write_records(recs, tmp_path / "records.jsonl")
    data.corpus_tokens(320)
    flags = ["--data", "instruct", "--pad", "--instruct-file", str(path), "--num-workers", "0"]
    fused = _run(tiny, *flags, "--loss", "fused", "--loss-chunk", "8")
    standard = _run(tiny, *flags)
    assert all(0 < s < 1 for s in standard["trained_share"])  # labels were masked
    _assert_same_curve(fused, standard)


@pytest.mark.parametrize("flags, layout", [
    (["--tp", "2"], "--tp 2"), (["--pp", "2", "--grad-accum", "2"], "--pp 2"),
    (["--cp", "2"], "--cp 2"), (["--impl", "hf-baseline"], "--impl hf-baseline")])
def test_layouts_without_a_fused_loss_are_refused_in_one_line(tiny, capsys, flags, layout):
    """Before any process group or model: one line naming --loss fused and what it runs on."""
    assert train.main(["--model", tiny, "--cpu", "--loss", "fused", *flags]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert not out and len(lines) == 1
    assert lines[0].startswith(f"error: --loss fused with {layout}") and "FSDP2" in lines[0]


def test_bench_dry_run_refuses_the_fused_loss_with_tensor_parallel(tiny):
    out = subprocess.run([sys.executable, "-m", "trainplan.cli", "bench", "--model", tiny,
                          "--cpu", "--tp", "2", "--nproc-per-node", "2", "--loss", "fused",
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--loss fused with --tp 2" in out.stderr.strip().splitlines()[-1]


def test_bad_loss_chunk_is_refused(tiny, capsys):
    assert train.main(["--model", tiny, "--cpu", "--loss", "fused", "--loss-chunk", "0"]) == 2
    assert "--loss-chunk = 0" in capsys.readouterr().err


def test_suite_loss_reaches_the_launch_the_prediction_and_the_matching():
    s = {"model": "llama-1.3b", "seq_len": 512, "configs": [
        {"tag": tag, "gpus": 2, "layout": {"dp": 2, "zero": 2}, **extra}
        for tag, extra in (("a", {"loss": "fused"}), ("b", {}))]}
    argv = {c["tag"]: suite.train_args(s, c, Path("out"), "r") for c in s["configs"]}
    assert argv["a"][argv["a"].index("--loss") + 1] == "fused" and "--loss" not in argv["b"]
    assert train.parse_args(argv["a"]).loss == "fused"
    pred = suite.predict(s, s["configs"][0], "NVIDIA H100 80GB HBM3", "r")
    assert pred["layout"]["loss"] == "fused"
    meas = {**pred, "kind": "measurement", "impl": "trainplan", "tag": "a", "seq_len": 512,
            "layout": {**pred["layout"], "compile": False},  # the allocator every harness run sets
            "provenance": {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}}
    assert same_config(pred, meas)
    assert not same_config(pred, {**meas, "layout": {**meas["layout"], "loss": "standard"}})


@pytest.mark.parametrize("text, shown", [
    ("configs:\n  - {tag: a, gpus: 2, loss: liger, layout: {dp: 2}}\n", "'liger'"),
    ("loss: 3\nconfigs:\n  - {tag: a, gpus: 2, layout: {dp: 2}}\n", "3"),  # the suite's
])
def test_suite_refuses_an_unknown_loss(tmp_path, text, shown):
    (tmp_path / "s.yaml").write_text(f"model: llama-1.3b\n{text}")
    with pytest.raises(SpecError, match=f"config 'a' loss = {shown}; use one of"):
        suite.load_suite(str(tmp_path / "s.yaml"))
