"""`trainplan bench`: bad input is one line and exit 2 before anything starts; a tiny real run.

The bad inputs run in-process (`cli.main`), so each costs milliseconds; the
launch commands are checked with --dry-run; one tiny CPU run goes through
torchrun as a user's would.
"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, trainplan_cli
from trainplan import cli

TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
SUITE = str(ROOT / "data/suites/baseline-2gpu.yaml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bench") / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


BAD = {  # id -> (arguments, a word the one-line message must name)
    "impl": (["--impl", "hf"], "hf"),
    "nproc-zero": (["--nproc-per-node", "0"], "'0'"),
    "no-model": (["--dp", "2"], "--model"),
    "world-mismatch": (["--model", "{tiny}", "--dp", "2", "--cpu"], "--nproc-per-node 2"),
    "nnodes-no-rdzv": (["--model", "{tiny}", "--nnodes", "2"], "--master-addr"),
    "node-rank-range": (["--model", "{tiny}", "--nnodes", "2", "--master-addr", "h",
                         "--node-rank", "2"], "--node-rank = 2"),
    "rdzv-no-id": (["--model", "{tiny}", "--nnodes", "2", "--rdzv-endpoint", "h:29400"],
                   "--rdzv-id"),
    "rdzv-bad-endpoint": (["--model", "{tiny}", "--nnodes", "2", "--rdzv-endpoint", "h",
                           "--rdzv-id", "j"], "'h'"),
    "rdzv-single-node": (["--model", "{tiny}", "--rdzv-endpoint", "h:1"], "--nnodes"),
    "unknown-preset": (["--model", "llama-2b"], "llama-2b"),
    "bad-recompute": (["--model", "{tiny}", "--recompute", "most"], "most"),
    "warmup-ge-steps": (["--model", "{tiny}", "--steps", "3", "--warmup", "3", "--cpu"],
                        "--warmup = 3"),
    "unknown-pass-through": (["--model", "{tiny}", "--cpu", "--", "--no-such-flag"],
                             "--no-such-flag"),
    "hf-with-tp": (["--model", "{tiny}", "--impl", "hf-baseline", "--tp", "2",
                    "--nproc-per-node", "2", "--cpu"], "tp = 2"),
    "trainer-zero1": (["--model", "{tiny}", "--impl", "hf-trainer", "--dp", "2", "--zero", "1",
                       "--nproc-per-node", "2", "--cpu"], "ZeRO-1"),
    "trainer-fsdp-on-cpu": (["--model", "{tiny}", "--impl", "hf-trainer", "--dp", "2",
                             "--zero", "3", "--nproc-per-node", "2", "--cpu"], "on CPU"),
    "trainer-selective": (["--model", "{tiny}", "--impl", "hf-trainer", "--recompute",
                           "selective", "--cpu"], "selective"),
    "layers-too-many": (["--model", "{tiny}", "--layers", "9", "--cpu"], "--layers = 9"),
    "records-folder": (["--model", "{tiny}", "--cpu", "--records", "{dir}"], "folder"),
    "records-on-cpu": (["--model", "{tiny}", "--cpu", "--records", "{dir}/r.jsonl"], "GPU"),
    "suite-missing": (["--suite", "no/such.yaml", "--out", "{dir}"], "no/such.yaml"),
    "suite-no-out": (["--suite", SUITE], "--out"),
    "suite-with-model": (["--suite", SUITE, "--out", "{dir}", "--model", "x"], "--model"),
    "suite-unknown-tag": (["--suite", SUITE, "--out", "{dir}", "--only", "nope"], "nope"),
    "out-without-suite": (["--model", "{tiny}", "--out", "{dir}"], "--suite"),
    "port-one-node": (["--model", "{tiny}", "--master-port", "99999"], "--master-port"),
    "port-with-c10d": (["--model", "{tiny}", "--nnodes", "2", "--dp", "2", "--rdzv-endpoint",
                        "h:29400", "--rdzv-id", "j", "--master-port", "1234"], "--master-port"),
    # harness flags that have no effect, or a value the run would crash on, refused up front
    "timeout-nan": (["--model", "{tiny}", "--cpu", "--", "--collective-timeout-s", "nan"],
                    "--collective-timeout-s = nan"),
    "max-norm-nan": (["--model", "{tiny}", "--cpu", "--", "--max-norm", "nan"],
                     "--max-norm = nan"),
    "max-norm-negative": (["--model", "{tiny}", "--cpu", "--", "--max-norm", "-1"],
                          "--max-norm = -1"),
    "prefetch-no-workers": (["--model", "{tiny}", "--cpu", "--num-workers", "0",
                             "--prefetch-factor", "4"], "--prefetch-factor 4"),
    "workers-synthetic": (["--model", "{tiny}", "--cpu", "--synthetic", "--num-workers", "4"],
                          "--num-workers 4 has no effect with --synthetic"),
    "pin-synthetic": (["--model", "{tiny}", "--cpu", "--synthetic", "--pin-memory"],
                      "--pin-memory has no effect with --synthetic"),
    "recipe-in-bf16": (["--model", "{tiny}", "--cpu", "--fp8-recipe", "rowwise"],
                       "--fp8-recipe rowwise"),
    "chunk-standard-loss": (["--model", "{tiny}", "--cpu", "--loss-chunk", "64"],
                            "--loss-chunk 64"),
    "keep-without-dir": (["--model", "{tiny}", "--cpu", "--", "--ckpt-keep", "5"],
                         "--ckpt-keep 5 needs --ckpt-dir"),
    "hash-without-dir": (["--model", "{tiny}", "--cpu", "--", "--ckpt-hash", "after-writing"],
                         "--ckpt-hash after-writing"),
    "gc-every-python": (["--model", "{tiny}", "--cpu", "--", "--gc", "python", "--gc-every",
                         "7"], "--gc-every 7"),
    "launches-without-suite": (["--model", "{tiny}", "--launches", "2"], "--launches"),
    "budget-without-suite": (["--model", "{tiny}", "--budget-s", "9"], "--budget-s"),
    # a suite's configs carry their own flags and GPU counts: a flag beside it is not used
    "suite-with-layout": (["--suite", SUITE, "--out", "{dir}", "--micro-batch", "8"],
                          "--micro-batch 8 is not used"),
    "suite-with-switch": (["--suite", SUITE, "--out", "{dir}", "--compile"], "--compile"),
    "suite-with-ranks": (["--suite", SUITE, "--out", "{dir}", "--nproc-per-node", "4"],
                         "--nproc-per-node"),
    "suite-with-port": (["--suite", SUITE, "--out", "{dir}", "--master-port", "29501"],
                        "--master-port"),
    "suite-with-passthrough": (["--suite", SUITE, "--out", "{dir}", "--", "--gc", "off"],
                               "--gc off is not used"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tiny, tmp_path, capsys):
    argv, word = BAD[case]
    argv = [a.format(tiny=tiny, dir=tmp_path) for a in argv]
    cut = argv.index("--") if "--" in argv else len(argv)  # bench's own flags before `--`
    assert cli.main(["bench", *argv[:cut], "--dry-run", *argv[cut:]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error:"), err
    assert word in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


def _dry(argv, capsys) -> list[str]:
    assert cli.main(["bench", "--dry-run", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["command"]


def test_a_suite_dry_run_prints_each_command_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(["bench", "--suite", SUITE, "--out", str(out), "--only", "hft-z0-mb24-c",
                     "tp-z2-mb16-c", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["tp-z2-mb16-c", "hft-z0-mb24-c"]  # suite order
    assert "-m trainplan.bench.harness.hf_trainer" in lines[1] and "--zero 0" in lines[1]
    assert "--run-id baseline-2gpu-" in lines[0] and f"{out}/measurements.jsonl" in lines[0]
    assert not out.exists()  # no predictions, no launch


def test_standalone_command(tiny, capsys):
    cmd = _dry(["--model", tiny, "--nproc-per-node", "2", "--dp", "2", "--zero", "3",
                "--compile", "--impl", "hf-baseline", "--cpu"], capsys)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    rest = cmd[cmd.index("trainplan.bench.harness.train") + 1:]
    assert " ".join(rest) == f"--model {tiny} --dp 2 --zero 3 --compile --cpu --impl hf-baseline"


def test_trainer_baseline_runs_its_own_module(tiny, capsys):
    cmd = _dry(["--model", tiny, "--nproc-per-node", "2", "--dp", "2", "--compile",
                "--impl", "hf-trainer", "--cpu"], capsys)
    rest = cmd[cmd.index("trainplan.bench.harness.hf_trainer") + 1:]
    assert " ".join(rest) == f"--model {tiny} --dp 2 --compile --cpu"  # no --impl: its module


def test_multi_node_static_and_c10d_commands(tiny, capsys):
    common = ["--model", tiny, "--nproc-per-node", "2", "--nnodes", "2", "--dp", "4", "--cpu"]
    static = _dry([*common, "--node-rank", "1", "--master-addr", "node0",
                   "--master-port", "1234"], capsys)
    assert "--standalone" not in static
    assert " ".join(static[3:13]) == ("--nproc-per-node 2 --nnodes 2 --node-rank 1 "
                                      "--master-addr node0 --master-port 1234")
    c10d = _dry([*common, "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7", "--",
                 "--seed", "3"], capsys)
    assert " ".join(c10d[5:13]) == ("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint "
                                    "node0:29400 --rdzv-id job7")
    assert c10d[-2:] == ["--seed", "3"]


@pytest.mark.slow
def test_tiny_cpu_run_through_the_verb(tiny, tmp_path):
    proc = trainplan_cli(["bench", "--model", tiny, "--seq-len", "32", "--micro-batch", "2",
                          "--steps", "4", "--warmup", "1", "--synthetic", "--cpu", "--json"],
                         cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    summary = out["summary"]
    assert summary["impl"] == "trainplan" and len(summary["losses"]) == 4
    assert "torch.distributed.run" in out["command"]
    assert "it/s" in proc.stderr  # the harness's progress bar, on stderr


def test_suite_prints_the_table_and_the_ratios(tmp_path, capsys, monkeypatch):
    """The suite runner mocked: the verb's job is the plumbing and the side-by-side figures."""
    from trainplan.bench.series import run as series_run

    def launch(seconds):
        return {"tokens_per_step": 32768, "ranks": 2, "step_times_s": [seconds] * 10,
                "step_time_s": seconds, "tokens_per_s_per_gpu": 16384 / seconds, "mfu": 0.5,
                "flops_per_token": 8.9e9, "peak_tflops": 989.0, "peak_mem_reserved_gib": 40.0}

    def fake_run(path, out, launches, only, budget_s):
        print("progress line")  # must land on stderr, not in the JSON
        pred = {"step_time_s": 0.25, "memory_gib": {"total": 40.0}}
        times = {"hf-z2-mb12-c": 0.4, "tp-z2-mb16-c": 0.25, "hf-z3-mb8": 0.4}
        return [(tag, pred, [launch(times[tag])] * launches) for tag in only]

    monkeypatch.setattr(series_run, "run_suite", fake_run)
    tags = ["hf-z2-mb12-c", "tp-z2-mb16-c", "hf-z3-mb8"]
    assert cli.main(["bench", "--suite", SUITE, "--out", str(tmp_path), "--only", *tags,
                     "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "progress line" in captured.err
    assert (out["best_trainplan"], out["best_baseline"], out["naive"]) == (
        "tp-z2-mb16-c", "hf-z2-mb12-c", "hf-z3-mb8")
    assert out["speedup_vs_best_baseline"] == pytest.approx(1.6)
    assert cli.main(["bench", "--suite", SUITE, "--out", str(tmp_path), "--only", *tags]) == 0
    assert "1.600x" in capsys.readouterr().out
