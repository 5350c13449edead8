"""The host-step bench: its tasks, one plain step in process, and a real 2-rank gloo run whose
records calibrate the step's host time outside the blocks."""

import statistics

import pytest

from trainplan.bench.micro import run as micro
from trainplan.bench.micro import step as micro_step
from trainplan.calibrate import host as calibrate_host
from trainplan.errors import SpecError
from trainplan.specs import load_model

TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 4\nffn: 128\nvocab: 256\n"


def _tasks(rank, world, benches, *flags):
    args = micro._parser().parse_args(["--out", "x", "--benches", benches, *flags])
    return micro._tasks(args, load_model("llama-1.3b"), rank, world)


def test_step_tasks_follow_the_block_tasks_per_rank_and_world():
    tiny = {"model": "llama-1.3b", "micro_batch": 1, "seq": micro.HOST_SEQ,
            "repeats": micro.BLOCK_REPEATS}
    depths = (24, micro.HOST_STEP_LAYERS)  # each wrapper at full depth, then its first 4
    plain = [("host-step", {**tiny, "tp": 1, "zero": 0, "layers": n}) for n in depths]
    four = [("host-step", {**tiny, "tp": t, "zero": z, "layers": n})
            for t, z in ((1, 2), (2, 0), (4, 0), (2, 3)) for n in depths]  # fsdp2, --tp-modes
    assert _tasks(0, 1, "host-step") == plain  # one rank: the plain model only
    assert _tasks(0, 4, "host-step") == plain + four and _tasks(1, 4, "host-step") == four
    assert _tasks(0, 2, "host-step") == plain + four[:4]  # tp 4 and tp2-z3 need 4 ranks
    for flag, want in (("0", [24]), ("24", [24]), ("30", [24]), ("2", [24, 2])):
        got = _tasks(0, 1, "host-step", "--host-step-layers", flag)
        assert [kw["layers"] for _, kw in got] == want  # the full depth alone, or two
    with pytest.raises(SpecError, match="host_step_layers = -1"):
        _tasks(0, 1, "host-step", "--host-step-layers", "-1")
    both = _tasks(0, 4, "host,host-step")
    assert both == _tasks(0, 4, "host") + plain + four  # in one launch, blocks first
    assert "host-step" not in {k for k, _ in _tasks(0, 4, "host")}  # `host` alone: unchanged
    assert {kw["repeats"] for _, kw in _tasks(1, 4, "host-step", "--block-repeats", "7")} == {7}
    with pytest.raises(SpecError, match="--host-seq 34"):
        _tasks(0, 4, "host-step", "--host-seq", "34")
    assert "host-step" in micro.BENCHES  # in the default --benches: validate's launch runs it


def test_bad_wrappers_are_refused_in_one_line(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    for kw, match in (({"tp": 2}, "tp = 2"), ({"zero": 1, "tp": 1}, "zero = 1"),
                      ({"zero": 2}, "FSDP needs")):  # one process: no second rank to shard on
        with pytest.raises(SpecError, match=match):
            micro_step.bench_host_step(str(model), 1, 16, dtype="float32", **kw)
    assert [micro_step.wrapper_of(t, z) for t, z in ((1, 0), (1, 2), (2, 0), (2, 3))] == \
        ["plain", "fsdp2", "tp", "tp+fsdp2"]


def test_one_plain_step_in_process_records_host_and_wall_times(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    kw = dict(compile=False, dtype="float32", warmup=0, repeats=3, extra={"purpose": "host-step"})
    r = micro_step.bench_host_step(str(model), 1, 16, **kw)
    short = micro_step.bench_host_step(str(model), 1, 16, layers=1, **kw)  # its first block
    assert (short["config"]["layers"], short["config"]["model_spec"]["n_layers"]) == (1, 1)
    assert short["config"]["model"] == r["config"]["model"] == "tiny"
    block = {"purpose": "host", "config": {"wrapper": None, "tp": 1},
             "results": {"time_s": 1e-6}}  # a made-up plain block: the two depths fit a line
    got = calibrate_host.host_scales([block, r, short])
    assert [w for w, _ in got["host_step_layer_s"]] == ["plain"] and got["host_step_s"]
    with pytest.raises(SpecError, match="layers = 3"):
        micro_step.bench_host_step(str(model), 1, 16, layers=3, **kw)
    c, res = r["config"], r["results"]
    assert r["bench"] == "block" and r["purpose"] == "host-step" and r["gpus"] == 1
    assert (c["wrapper"], c["tp"], c["zero"], c["layers"], c["micro_batch"], c["seq"]) == \
        ("plain", 1, 0, 2, 1, 16)
    assert c["warmup"] == 1  # the first step (compile, lazy state) is never timed
    assert c["optimizer"] == "adamw" and c["max_norm"] == 1.0 and not c["compile"]
    assert len(res["times_s"]) == len(res["wall_times_s"]) == 3
    assert all(0 < h <= w for h, w in zip(res["times_s"], res["wall_times_s"], strict=True))
    assert res["time_s"] == pytest.approx(statistics.median(res["times_s"]))
    assert calibrate_host.is_host(r) and calibrate_host.wrapper_name(c) == "plain"


@pytest.mark.slow
def test_two_rank_host_bench_records_whole_steps_that_calibrate(host_launch):
    """Real torchrun, 2 gloo ranks, one launch (`host_launch`, shared with
    test_micro_host.py): the host blocks, then the whole tiny model's step plain (rank 0),
    FSDP2 ZeRO-2 and TP 2, compiled, at micro-batch 1 and seq 64."""
    every = host_launch
    steps = [r for r in every if r["purpose"] == "host-step"]
    assert every[-len(steps):] == steps  # after the blocks
    assert [(r["config"]["wrapper"], r["config"]["tp"], r["config"]["zero"], r["gpus"],
             r["config"]["layers"]) for r in steps] == \
        [(w, t, z, g, n) for w, t, z, g in (("plain", 1, 0, 1), ("fsdp2", 1, 2, 2),
                                            ("tp", 2, 0, 2)) for n in (2, 1)]
    for r in steps:
        c, res = r["config"], r["results"]
        assert r["bench"] == "block" and r["model"] == "tiny"
        assert c["micro_batch"] == 1 and c["seq"] == micro.HOST_SEQ
        assert c["compile"] and c["warmup"] == 1 and c["repeats"] == 6
        assert res["time_s"] > 0 and len(res["times_s"]) == 6 and len(res["time_s_ci"]) == 2
        assert all(t > 0 for t in res["times_s"]) and res["wall_s"] >= res["time_s"]
    got = calibrate_host.host_scales(every)
    blocks = dict(got["host_block_s"])
    want_a, want_b = [], []
    for w in sorted(blocks):  # a line through the two depths: 2 blocks and 1
        t2, t1 = (r["results"]["time_s"] for r in steps
                  if calibrate_host.wrapper_name(r["config"]) == w)
        want_a.append([w, pytest.approx(max(0.0, 2 * t1 - t2), abs=1e-7)])
        want_b.append([w, pytest.approx(max(0.0, t2 - t1 - blocks[w]), abs=1e-7)])
    assert [w for w, _ in want_a] == ["fsdp2", "plain", "tp2"]
    assert got["host_step_s"] == want_a and got["host_step_layer_s"] == want_b
    # the full depth alone: everything outside the blocks once a step, as before
    full = calibrate_host.host_scales([r for r in every if r["purpose"] != "host-step"
                                       or r["config"]["layers"] == 2])
    assert full["host_step_s"] == [[w, round(max(0.0, t - 2 * blocks[w]), 7)] for w, t in sorted(
        (calibrate_host.wrapper_name(r["config"]), r["results"]["time_s"]) for r in steps
        if r["config"]["layers"] == 2)] and "host_step_layer_s" not in full
