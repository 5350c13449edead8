"""The memory-stack bench: its tasks (opt-in), its refusals, a tiny model at two depths on CPU
in process, and a real 2-rank gloo run of its four wrappers."""

import json

import pytest

from trainplan.bench.micro import memory as micro_memory
from trainplan.bench.micro import run as micro
from trainplan.calibrate import memory as calibrate_memory
from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.errors import SpecError
from trainplan.specs import load_model

from .micro_runs import run_micro

TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 4\nffn: 128\nvocab: 256\n"


def _tasks(rank, world, benches, *flags):
    args = micro._parser().parse_args(["--out", "x", "--benches", benches, *flags])
    return micro._tasks(args, load_model("llama-1.3b"), rank, world)


def test_stack_tasks_per_rank_and_world_and_not_in_the_default_launch():
    base = {"model": "llama-1.3b", "micro_batch": 8, "seq": 2048}  # --tokens 16384 / --seq-len
    plain = [("memory-stack", {**base, "tp": 1, "zero": 0, "layers": (n,)}) for n in (2, 4)]
    two = [("memory-stack", {**base, "tp": t, "zero": z, "layers": (n,)})
           for t, z in ((1, 2), (1, 3), (2, 0)) for n in (2, 4)]  # tp 4, tp2-z3 need 4 ranks
    assert _tasks(0, 1, "memory-stack") == plain  # one rank: the plain model only
    assert _tasks(0, 2, "memory-stack") == plain + two and _tasks(1, 2, "memory-stack") == two
    four = _tasks(1, 4, "memory-stack")
    assert [(kw["tp"], kw["zero"]) for _, kw in four][6:] == [(4, 0), (4, 0), (2, 3), (2, 3)]
    got = _tasks(0, 1, "memory-stack", "--memory-layers", "4,1,4", "--tokens", "4096",
                 "--seq-len", "4096")
    assert [(kw["layers"], kw["micro_batch"], kw["seq"]) for _, kw in got] == \
        [((1,), 1, 4096), ((4,), 1, 4096)]
    assert "memory-stack" not in micro.BENCHES and "memory-stack" in micro.OPT_IN
    default = micro._parser().parse_args(["--out", "x"])  # what validate's launch runs
    assert "memory-stack" not in {k for k, _ in micro._tasks(
        default, load_model("llama-1.3b"), 0, 4)}


def test_a_sequence_tp_does_not_divide_is_refused_where_tp_runs():
    with pytest.raises(SpecError, match="--seq-len 2047"):
        _tasks(0, 2, "memory-stack", "--seq-len", "2047", "--tokens", "2047")
    assert len(_tasks(0, 1, "memory-stack", "--seq-len", "2047")) == 2  # one rank: no TP


@pytest.mark.parametrize("flags, match", [
    (("--memory-layers", "0"), "--memory-layers '0'"),
    (("--memory-layers", "2,x"), "--memory-layers '2,x'"),
    (("--memory-layers", "2,25"), "--memory-layers '2,25'"),  # llama-1.3b has 24 blocks
    (("--benches", "memory-stacks"), "--benches 'memory-stacks'"),
])
def test_bad_flags_exit_2_with_one_line(flags, match, tmp_path, capsys):
    with pytest.raises(SpecError, match=match):
        _tasks(0, 2, "memory-stack", *flags)
    out = tmp_path / "m.jsonl"  # refused before any bench runs (one process: rank 0)
    argv = ["--out", str(out), "--benches", "memory-stack", *flags]
    if "--benches" in flags:
        argv = ["--out", str(out), *flags]
    assert micro.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not valid" in err and not out.exists()


def test_bad_wrappers_and_depths_are_refused_in_one_line(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    for kw, match in (({"tp": 2}, "tp = 2"), ({"zero": 1}, "zero = 1"),
                      ({"zero": 2}, "FSDP needs"), ({"layers": (3,)}, "layers = "),
                      ({"layers": (0, 2)}, "layers = "), ({"layers": ()}, "layers = "),
                      ({"steps": 0}, "steps = 0")):
        with pytest.raises(SpecError, match=match):
            micro_memory.bench_memory_stack(str(model), 1, 16, dtype="float32",
                                            **{"layers": (1, 2), **kw})


def test_side_pools_are_other_streams_whole_segments_of_this_device():
    segments = [{"device": 0, "stream": 0, "total_size": 100, "allocated_size": 60},
                {"device": 0, "stream": 7, "total_size": 30, "allocated_size": 10},
                {"device": 0, "stream": 9, "total_size": 20, "allocated_size": 0},
                {"device": 1, "stream": 7, "total_size": 999, "allocated_size": 0}]
    assert micro_memory.side_pool_bytes(segments, 0, 0) == 50
    assert micro_memory.side_pool_bytes(segments, 0, 7) == 120
    assert micro_memory.side_pool_bytes([], 0, 0) == 0


def test_a_tiny_model_at_two_depths_on_cpu_writes_records_without_bytes(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    common = {"dtype": "float32", "warmup": 1, "iters": 2, "repeats": 6, "run_id": "r",
              "extra": {"model": "tiny", "tp": 1}}
    kw = {"model": str(model), "micro_batch": 1, "seq": 16, "tp": 1, "zero": 0,
          "compile": False, "steps": 2}
    recs = [micro._run("memory-stack", {**kw, "layers": (n,)}, common) for n in (1, 2)]
    for n, r in zip((1, 2), recs, strict=True):
        c, res = r["config"], r["results"]
        assert r["bench"] == "block" and r["purpose"] == "memory-stack" and r["gpus"] == 1
        assert r["model"] == c["model"] == "tiny" and r["run_id"] == "r"
        assert (c["wrapper"], c["tp"], c["zero"], c["world"], c["layers"]) == \
            ("plain", 1, 0, 1, n)
        assert c["model_spec"]["n_layers"] == n and c["micro_batch"] == 1 and c["seq"] == 16
        assert c["warmup"] == 1 and c["steps"] == 2 and not c["compile"]
        assert len(res["times_s"]) == 2 and res["time_s"] > 0 and res["tokens_per_s"] > 0
        assert all(res[k] is None for k in micro_memory.BYTES)  # no allocator on CPU
        json.dumps(r, allow_nan=False)
    both = micro_memory.bench_memory_stack(str(model), 1, 16, layers=(1, 2), compile=False,
                                           dtype="float32", warmup=0, steps=1,
                                           extra={"purpose": "memory-stack"})
    assert [r["config"]["layers"] for r in both] == [1, 2]
    assert all(calibrate_memory.is_stack(r) for r in both)
    assert calibrate_memory.fragmentation_scales(recs + both, None, calibrate_pieces._spec) == {}
    from trainplan.bench.micro.report import summary

    assert summary(recs[0])[0] == "block"  # the end-of-run table reads it


@pytest.mark.slow
def test_two_rank_memory_stack_runs_every_wrapper_at_two_depths(tmp_path):
    """Real torchrun, 2 gloo ranks, compiled: plain (rank 0), FSDP2 ZeRO-2 and ZeRO-3, TP 2,
    the tiny model's first block and both, micro-batch 1 of 32 tokens."""
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    out = tmp_path / "micro.jsonl"
    every, table = run_micro(out, 2, "--model", str(model), "--benches", "memory-stack",
                             "--memory-layers", "1,2", "--seq-len", "32", "--tokens", "32",
                             "--warmup", "1", timeout=600)
    assert [(r["config"]["wrapper"], r["config"]["tp"], r["config"]["zero"], r["gpus"],
             r["config"]["layers"]) for r in every] == \
        [(w, t, z, g, n) for w, t, z, g in (("plain", 1, 0, 1), ("fsdp2", 1, 2, 2),
                                            ("fsdp2", 1, 3, 2), ("tp", 2, 0, 2))
         for n in (1, 2)]
    for r in every:
        assert r["purpose"] == "memory-stack" and r["bench"] == "block"
        assert r["config"]["compile"] and r["config"]["micro_batch"] == 1
        assert r["results"]["time_s"] > 0 and r["results"]["peak_reserved_bytes"] is None
    assert "microbenchmarks" in table
