"""The host-time bench: its task list per rank and world, and a real 2-rank gloo run."""

from pathlib import Path

import pytest

from trainplan.bench.micro import run as micro
from trainplan.calibrate import host as calibrate_host
from trainplan.errors import SpecError
from trainplan.specs import load_model

ROOT = Path(__file__).resolve().parents[2]


def _tasks(rank, world, *flags):
    args = micro._parser().parse_args(["--out", "x", "--benches", "host", *flags])
    return micro._tasks(args, load_model("llama-1.3b"), rank, world)


def test_host_tasks_are_tiny_blocks_per_rank_and_world():
    tiny = {"model": "llama-1.3b", "micro_batch": 1, "seq": micro.HOST_SEQ,
            "repeats": micro.BLOCK_REPEATS}  # host-bound: more repeats than --repeats
    block = {"of": "block", "compile": True, "recompute": "none", "precision": "pure"}
    sweep = [("interleave", {**tiny, **block, "micro_batch": mb, "seq": 2048})
             for mb in micro.SWEEP_MICRO_BATCHES]  # at --seq-len, where GPU and host meet
    plain = [("host", {**tiny, **block})] + sweep
    assert _tasks(0, 1) == plain  # one rank: the plain block only
    four = [("host", {**tiny, "of": "fsdp", "zero": 2, "two_blocks": True}),
            ("host", {**tiny, "of": "tp", "tp": 2, "zero": 0}),
            ("host", {**tiny, "of": "tp", "tp": 4, "zero": 0}),
            ("host", {**tiny, "of": "tp", "tp": 2, "zero": 3})]
    assert _tasks(0, 4) == plain + four and _tasks(1, 4) == four
    assert micro.HOST_SEQ % 4 == 0
    assert [kw["seq"] for k, kw in _tasks(0, 2, "--host-seq", "32") if k == "host"] == [32] * 3
    with pytest.raises(SpecError, match="--host-seq 34"):
        _tasks(0, 4, "--host-seq", "34")  # tp 4 does not divide it
    with pytest.raises(SpecError, match="host_seq"):
        _tasks(0, 1, "--host-seq", "0")
    assert {kw["repeats"] for _, kw in _tasks(0, 4, "--block-repeats", "9")} == {9}
    with pytest.raises(SpecError, match="block_repeats"):
        _tasks(0, 1, "--block-repeats", "0")


@pytest.mark.slow
def test_two_rank_host_bench_records_marked_blocks(host_launch):
    """Real torchrun, 2 gloo ranks: plain (rank 0), FSDP2 ZeRO-2 and TP 2 at seq 64. The
    launch is the one test_micro_step.py reads (`host_launch`); its whole steps left out."""
    every = [r for r in host_launch if r["purpose"] != "host-step"]
    sweep = [r for r in every if r["purpose"] == "interleave"]
    assert [(r["config"]["micro_batch"], r["config"]["seq"]) for r in sweep] == [
        (mb, 32) for mb in micro.SWEEP_MICRO_BATCHES]
    got = [r for r in every if r["purpose"] == "host"]
    assert len(got) + len(sweep) == len(every) and all(r["bench"] == "block" for r in every)
    assert [calibrate_host.wrapper_name(r["config"]) for r in got] == ["plain", "fsdp2", "tp2"]
    for r in got:
        c = r["config"]
        assert c["micro_batch"] == 1 and c["seq"] == micro.HOST_SEQ and c["compile"]
        assert r["results"]["time_s"] > 0 and len(r["results"]["times_s"]) == 6
        if c.get("wrapper"):  # FSDP2 and TP: two blocks under one root, less one
            assert c["blocks"] == [1, 2] and "per_block_from" in r["results"]
            assert r["results"]["root_s"] == pytest.approx(
                r["results"]["one_block_s"] - r["results"]["time_s"])
    table = calibrate_host.host_scales(every)["host_block_s"]  # the sweep left out
    assert [w for w, _ in table] == ["fsdp2", "plain", "tp2"] and all(t > 0 for _, t in table)
