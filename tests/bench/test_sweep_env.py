"""A sweep's run with its own environment (`"env"` in RUNS.json): set for that run only,
recorded in that run's provenance, and its device mesh built from new process groups
(`parallelize.build_mesh(fresh=True)`) that train as the default group does, tensor parallel
too; refused under context parallel. Real torchrun, two gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
                   {"tag": "plain", "args": [*base, "--run-id", "plain"]},
                   {"tag": "own-tp", "env": {"NCCL_PROTO": "LL"},
                    "args": [*base[:-8], *base[-4:], "--tp", "2", "--run-id", "tp"]},
                   {"tag": "own-cp", "args": [*base[:-8], "--cp", "2", "--run-id", "cp"],
                    "env": {"NCCL_PROTO": "LL"}}], 2, tmp_path,
                  env={"NCCL_PROTO": "Simple"})
    assert "--cp 1" in lines["own-cp"]["error"] and "--cp 2" in lines["own-cp"]["error"]
    assert "error" not in lines["own-tp"], lines["own-tp"]
    own, plain = lines["own"]["summary"], lines["plain"]["summary"]
    assert own["losses"] == plain["losses"]  # new groups, the same training
    records = {r["run_id"]: r for r in map(json.loads, rec.read_text().splitlines())}
    knobs_own = records["own"]["provenance"]["env"]
    knobs_plain = records["plain"]["provenance"]["env"]
    assert knobs_own.get("NCCL_ALGO") == "Ring" and "NCCL_PROTO" not in knobs_own
    assert "NCCL_ALGO" not in knobs_plain and knobs_plain.get("NCCL_PROTO") == "Simple"
    assert records["tp"]["provenance"]["env"].get("NCCL_PROTO") == "LL"
    assert records["tp"]["layout"]["tp"] == 2


MESHES = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from trainplan.bench.series.sweep import settle

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for run in range(2):  # two runs' meshes: equal as DeviceMesh compares them, other groups
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    w = distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)])
    x = distribute_tensor(torch.ones(4, 8), mesh, [Replicate()])
    print(run, (x @ w.t()).device_mesh is mesh)
    settle()
dist.destroy_process_group()
"""


def test_after_settle_a_runs_dtensor_ops_are_on_its_own_mesh():
    """Without `clear_dtensor_caches` the second run's product lands on the first run's mesh
    (DTensor's sharding cache), and its collectives would use the first run's groups."""
    lib = Path(__file__).resolve().parents[2] / "lib"
    proc = subprocess.run([sys.executable, "-c", MESHES], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(lib)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "True", "1", "True"], proc.stdout


def test_the_nccl_check_without_gpus_is_one_line_exit_2():
    lib = Path(__file__).resolve().parents[2] / "lib"
    proc = subprocess.run([sys.executable, "-m", "trainplan.bench.micro.nccl_env"],
                          env=dict(os.environ, PYTHONPATH=str(lib), CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "needs GPUs" in err[0], proc.stderr
