"""A sweep's run with its own environment (`"env"` in RUNS.json): set for that run only,
recorded in that run's provenance, and its device mesh built from new process groups
(`parallelize.build_mesh(fresh=True)`) that train as the default group does. Real torchrun,
two gloo ranks."""

from __future__ import annotations

import json
import os

from trainplan.bench.series.sweep import environment

from .sweep_runs import sweep

TINY = "n_layers: 2\nhidden: 32\nn_heads: 2\nn_kv_heads: 2\nffn: 64\nvocab: 256\n"


def test_environment_sets_unsets_and_restores(monkeypatch):
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    with environment({"NCCL_ALGO": "Ring", "NCCL_PROTO": None}):
        assert os.environ["NCCL_ALGO"] == "Ring" and "NCCL_PROTO" not in os.environ
    assert os.environ["NCCL_PROTO"] == "Simple" and "NCCL_ALGO" not in os.environ


def test_a_run_with_its_own_environment_records_it_and_trains_alike(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    rec = tmp_path / "records.jsonl"
    base = ["--model", str(tmp_path / "tiny.yaml"), "--seq-len", "32", "--micro-batch", "2",
            "--steps", "4", "--warmup", "1", "--seed", "0", "--synthetic", "--cpu",
            "--dp", "2", "--zero", "3", "--records", str(rec), "--peak-tflops", "1"]
    lines = sweep([{"tag": "own", "args": [*base, "--run-id", "own"],
                    "env": {"NCCL_ALGO": "Ring", "NCCL_PROTO": None}},
                   {"tag": "plain", "args": [*base, "--run-id", "plain"]}], 2, tmp_path,
                  env={"NCCL_PROTO": "Simple"})
    own, plain = lines["own"]["summary"], lines["plain"]["summary"]
    assert own["losses"] == plain["losses"]  # new groups, the same training
    records = {r["run_id"]: r for r in map(json.loads, rec.read_text().splitlines())}
    knobs_own = records["own"]["provenance"]["env"]
    knobs_plain = records["plain"]["provenance"]["env"]
    assert knobs_own.get("NCCL_ALGO") == "Ring" and "NCCL_PROTO" not in knobs_own
    assert "NCCL_ALGO" not in knobs_plain and knobs_plain.get("NCCL_PROTO") == "Simple"


def test_the_nccl_check_without_gpus_is_one_line_exit_2():
    import subprocess
    import sys
    from pathlib import Path

    lib = Path(__file__).resolve().parents[2] / "lib"
    proc = subprocess.run([sys.executable, "-m", "trainplan.bench.micro.nccl_env"],
                          env=dict(os.environ, PYTHONPATH=str(lib), CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "needs GPUs" in err[0], proc.stderr
