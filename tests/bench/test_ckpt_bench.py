"""The checkpoint benchmark under real torchrun: 2 CPU ranks, gloo, the tiny model (< 60 s).

Timings on CPU say nothing about a GPU's, so they are not compared; the
test checks that every number the page-5 figures read is measured and sane:
raw write bandwidth, per-save stall and persist time for both modes, bytes
equal to the checkpoint folder on disk, a resume whose state matches the
state saved, the record valid, the table printed last. Bad flags are refused
in one line with exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan.bench.ckpt import manifest as mf
from trainplan.records import schema as records

LIB = Path(__file__).resolve().parents[2] / "lib"
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
FLAGS = ["--dp", "2", "--zero", "2", "--cpu", "--synthetic", "--seq-len", "32",
         "--micro-batch", "2", "--warmup", "1", "--raw-gib", "0.0625", "--raw-block-mib", "4",
         "--steps-per-mode", "4", "--every", "2", "--no-progress"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                TRAINPLAN_FAULT="", TRAINPLAN_GIT_COMMIT="test-commit",
                PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt-bench")
    (tmp / "tiny.yaml").write_text(TINY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "trainplan.bench.series.ckpt_bench", "--out", str(tmp / "out"), "--ckpt-root",
           str(tmp / "ck"), "--model", str(tmp / "tiny.yaml"), *FLAGS, "--keep-checkpoints"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, proc


@pytest.mark.slow
def test_one_launch_measures_raw_write_stall_persist_and_restart(launched):
    tmp, proc = launched
    recs = records.load(tmp / "out" / "ckpt-records.jsonl")  # validated on the way in
    assert [r["kind"] for r in recs] == ["checkpoint"]
    rec = recs[0]
    assert rec["ranks"] == 2 and rec["device"] == "cpu" and rec["layout"]["zero"] == 2
    assert rec["provenance"]["torch"] and rec["provenance"]["git_commit"]
    raw = rec["raw_write"]
    assert raw["bytes"] == 64 * 2**20 and raw["seconds"] > 0 and raw["gbps"] > 0
    saves = rec["saves"]
    assert [(s["mode"], s["step"]) for s in saves] == [("sync", 3), ("sync", 5),
                                                       ("async", 7), ("async", 9)]
    for s in saves:
        assert s["committed"] and s["stall_s"] > 0 and s["persist_s"] > 0 and s["bytes"] > 0
        assert s["persist_gbps"] == pytest.approx(s["bytes"] / s["persist_s"] / 1e9)
    # the bytes are the checkpoint folder on disk (every file but the manifest itself)
    folder = tmp / "ck" / "trainplan-ckpt-bench" / mf.step_name(9)
    on_disk = sum(p.stat().st_size for p in folder.iterdir() if p.name != mf.MANIFEST)
    assert saves[-1]["bytes"] == on_disk
    assert mf.verify(folder)[0]["step"] == 9
    s = rec["summary"]
    for mode in ("sync", "async"):  # measured, not compared: CPU timings mean nothing here
        assert s[f"{mode}_stall_s"] > 0 and s[f"persist_gbps_{mode}"] > 0
        assert s[f"persist_vs_raw_{mode}"] == pytest.approx(s[f"persist_gbps_{mode}"]
                                                           / s["raw_write_gbps"])
    print(f"CPU: sync stall {s['sync_stall_s']:.3f} s, async stall {s['async_stall_s']:.3f} s")
    r = rec["restart"]
    assert r["resumed_step"] == r["last_committed"] == 9 and r["state_matches"] is True
    assert 0 < r["load_s"] <= r["build_and_load_s"] < r["restart_to_first_step_s"]
    assert r["first_step_s"] > 0 and r["cold_start_s"] > 0
    assert rec["async_options"]["stager"]
    assert rec["writer"]["hash"] == "while-writing"  # the default: no shard read back after
    out = proc.stdout.strip().splitlines()
    assert out[-1].startswith("record appended to") and "restart to first step" in out[-2]
    assert any(x.startswith("stall per save (s)") for x in out)


@pytest.mark.slow
def test_a_malformed_checkpoint_record_is_refused_naming_the_field(launched):
    tmp, _ = launched
    good = json.loads((tmp / "out" / "ckpt-records.jsonl").read_text().splitlines()[0])
    for broken, words in [
        (lambda r: r["summary"].pop("sync_stall_s"), "missing 'sync_stall_s'"),
        (lambda r: r["summary"].__setitem__("persist_vs_raw_async", "80%"),
         "summary.persist_vs_raw_async"),
        (lambda r: r["saves"][0].__setitem__("mode", "lazy"), "saves[0].mode"),
        (lambda r: r["saves"][1].pop("stall_s"), "missing 'stall_s'"),
    ]:
        rec = json.loads(json.dumps(good))
        broken(rec)
        path = tmp / "bad.jsonl"
        path.write_text(json.dumps(rec) + "\n")
        with pytest.raises(records.RecordError) as err:
            records.load(path)
        assert words in str(err.value) and "bad.jsonl:1:" in str(err.value), str(err.value)


@pytest.mark.parametrize("flags, words", [
    (["--every", "3"], "--steps-per-mode = 4 must be a positive multiple of --every = 3"),
    (["--raw-gib", "0"], "--raw-gib = 0.0 must be > 0"),
    (["--steps", "9"], "--steps is set by the benchmark"),
    (["--ckpt-dir", "x"], "--ckpt-dir is set by the benchmark"),
    (["--keep", "1"], "--keep = 1: keep at least 2"),
    (["--ckpt-root", "/proc/no/such"], "--ckpt-root /proc/no/such: cannot create it"),
])
def test_bad_flags_are_refused_in_one_line_with_exit_2(tmp_path, flags, words):
    cmd = [sys.executable, "-m", "trainplan.bench.series.ckpt_bench", "--out", str(tmp_path),
           "--ckpt-root", str(tmp_path / "ck"), "--model", "llama-1.3b", *FLAGS, *flags]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {words}"] or words in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
