"""The TP block microbenchmark: its flags, and a real 4-rank gloo run feeding a calibration."""

import dataclasses
from pathlib import Path

import pytest

from trainplan.bench.micro import run as micro
from trainplan.bench.micro import timing
from trainplan.bench.micro import tp as micro_tp
from trainplan.calibrate import tp as calibrate_tp
from trainplan.calibrate.store import load_gpu
from trainplan.errors import SpecError
from trainplan.specs import load_model

from .micro_runs import run_micro

ROOT = Path(__file__).resolve().parents[2]
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 4\nffn: 128\nvocab: 256\n"


def test_tp_modes_and_what_a_world_can_lay_out():
    assert micro_tp.tp_modes("tp2, tp4,tp2-z3") == [(2, 0), (4, 0), (2, 3)]
    assert micro_tp.runnable([(2, 0), (4, 0), (2, 3), (8, 0)], 4) == [(2, 0), (4, 0), (2, 3)]
    assert micro_tp.runnable([(2, 0), (4, 0), (2, 3)], 2) == [(2, 0)]  # FSDP needs dp >= 2
    for bad in ("tp1", "tp", "2", "tp2-z1", "tp2-z3-x", " , "):
        with pytest.raises(SpecError, match="--tp-modes"):
            micro_tp.tp_modes(bad)


def test_bad_tp_modes_give_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "micro.jsonl"
    assert micro.main(["--out", str(out), "--benches", "tp", "--tp-modes", "tp2,z3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'z3'" in err[0] and not out.exists()


def test_per_block_is_two_blocks_minus_one_with_a_fallback():
    one, two = [3.0, 3.2, 2.9, 3.1, 3.0, 3.4], [4.0, 4.1, 4.0, 4.3, 3.9, 4.2]
    got = timing.per_block(one, two, tokens=128)
    assert got["per_block_from"] == timing.FROM_DIFFERENCE
    assert got["one_block_s"] == pytest.approx(3.05) and got["two_blocks_s"] == pytest.approx(4.05)
    assert got["time_s"] == pytest.approx(1.0) and got["root_s"] == pytest.approx(2.05)
    assert got["times_s"] == pytest.approx([1.0, 0.9, 1.1, 1.2, 0.9, 0.8])
    low, high = got["time_s_ci"]
    assert low < got["time_s"] < high and low == pytest.approx(3.9 - 3.4)  # min(two) - max(one)
    assert got["tokens_per_s"] == pytest.approx(128.0)
    assert got["one_block_times_s"] == one and got["two_blocks_times_s"] == two
    noisy = timing.per_block(one, [2.9, 3.0, 3.1, 3.0, 2.8, 3.0], tokens=128)
    assert noisy["per_block_from"] == timing.FROM_ONE_BLOCK
    assert noisy["time_s"] == noisy["one_block_s"] == pytest.approx(3.05)
    assert noisy["root_s"] == 0.0 and noisy["times_s"] == one
    wide = timing.per_block([1.0] * 5 + [3.0], [1.5] * 6, tokens=10)  # interval reaches 0
    assert wide["time_s"] == pytest.approx(0.5) and wide["tokens_per_s_ci"][1] is None


@pytest.mark.slow
def test_four_rank_tp_blocks_record_and_calibrate(tmp_path):
    """Real torchrun, 4 gloo ranks: TP 2 (two groups side by side), TP 4, TP 2 x FSDP2."""
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    out = tmp_path / "micro.jsonl"
    recs, _ = run_micro(out, 4, "--model", str(model), "--benches", "tp",
                        "--tp-modes", "tp2,tp4,tp2-z3,tp8", "--tokens", "128", "--seq-len", "64",
                        "--warmup", "1", "--iters", "2", "--repeats", "6", "--block-repeats", "6",
                        timeout=500)
    got = [r for r in recs if r["bench"] == "block"]
    assert [(r["config"]["wrapper"], r["config"]["tp"], r["config"]["dp"], r["config"]["zero"])
            for r in got] == [("tp", 2, 2, 0), ("tp", 4, 1, 0), ("tp+fsdp2", 2, 2, 3)]  # no tp8
    for r in got:
        c = r["config"]
        assert r["gpus"] == c["world"] == 4 and c["sequence_parallel"] and c["compile"]
        assert c["precision"] == "pure"  # float32 on CPU: no autocast
        assert c["micro_batch"] == 2 and c["tokens"] == 128 and r["results"]["time_s"] > 0
        assert len(r["results"]["times_s"]) == 6
        res = r["results"]
        assert c["blocks"] == [1, 2] and res["one_block_s"] > 0 and res["two_blocks_s"] > 0
        assert res["per_block_from"] in (timing.FROM_DIFFERENCE, timing.FROM_ONE_BLOCK)
        assert res["per_block_from"] in ("two blocks - one block",
                                         "one block (difference not positive)")
        assert res["root_s"] == pytest.approx(res["one_block_s"] - res["time_s"])
        assert len(res["one_block_times_s"]) == len(res["two_blocks_times_s"]) == 6
    cpu = dataclasses.replace(load_gpu("h100-sxm", calibrated=False), bf16_tflops=0.5,
                              hbm_tbps=0.2)
    scales = calibrate_tp.tp_scales(got, cpu, lambda r: load_model(str(model)))
    assert [row[:2] for row in scales["tp_block_scales"]] == [[2, 0], [2, 1], [4, 0]]
    assert all(row[2] >= calibrate_tp.MIN_TP_SCALE for row in scales["tp_block_scales"])
