"""Profile JSONs in the planner's terms: the mapping, its bounds, bad files, pairing, figure.

The profiles here are made by bench/profile.py's own `summarise` from fake kernel events;
the top-level keys around it mirror `profile.main`'s `out` dict (main has no function of its
own for them), and one test loads what `profile.main` writes on CPU.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import matplotlib
import pytest
from torch.autograd import DeviceType

matplotlib.use("Agg")

from trainplan.bench.observe import profile  # noqa: E402
from trainplan.compare import accuracy as compare  # noqa: E402
from trainplan.compare import trace_split
from trainplan.errors import RecordError  # noqa: E402
from trainplan.runbook import figures

LAYOUT = {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 3, "dp_shard": 2,
          "micro_batch": 8, "grad_accum": 1, "recompute": "none", "compile": True,
          "sequence_parallel": True, "pp_schedule": "1f1b", "pp_virtual": 1}
ACTIVE = 2
# kernel name -> microseconds per step; one per bucket (profile.bucket_of picks it)
KERNELS = {"sm90_xmma_gemm_bf16bf16_bf16f32": 100_000, "pytorch_flash::flash_fwd_kernel": 30_000,
           "triton_per_fused_add_mul_0": 20_000, "Memcpy DtoD (Device -> Device)": 10_000,
           "vectorized_elementwise_kernel<FillFunctor>": 5_000,
           "ncclDevKernel_AllGather_RING_LL": 60_000, "fused_adam_kernel": 4_000}
COMPUTE_S = 0.165  # gemm + flash + triton + memcpy + fill
OPTIMIZER_S, COLLECTIVES_S = 0.004, 0.060


def fake_events() -> list:
    """Kernel events as `key_averages()` lists them, totals over ACTIVE steps; a CPU operator
    too, which `summarise` must skip."""
    ev = [SimpleNamespace(key=k, device_type=DeviceType.CUDA, self_device_time_total=us * ACTIVE,
                          self_cpu_time_total=0, count=3 * ACTIVE) for k, us in KERNELS.items()]
    return ev + [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU,
                                 self_device_time_total=999_999, self_cpu_time_total=50,
                                 count=1)]


def make_profile(step_s: float = 0.25, card: str = "NVIDIA H200", **extra) -> dict:
    """profile.main's `out`, its kernel part from profile.summarise."""
    return {"impl": "trainplan", "sdpa": "default", "layout": dict(LAYOUT), "card": card,
            "active_steps": ACTIVE, "step_time_s": step_s,
            "step_time_s_unprofiled_median": step_s * 0.95,
            **profile.summarise(fake_events(), ACTIVE, device=True), **extra}


def write(tmp_path, prof, name="prof.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(prof) if isinstance(prof, dict) else prof)
    return str(path)


def row(config="tp2-fsdp2-mb8-c", host="4 x NVIDIA H200", card="NVIDIA H200", **layout) -> dict:
    """A compare row (trainplan.compare.matching.make_row's keys that pairing reads)."""
    return {"config": config, "host": host, "card": card, "impl": "trainplan",
            "model": "llama-1.3b", "gpus": 4, "layout": {**LAYOUT, **layout},
            "predicted_split_s": {"compute": 0.12, "exposed_comm": 0.03, "bubble": 0.0,
                                  "optimizer": 0.004},
            "predicted_step_time_s": 0.154, "measured_step_time_s": 0.244,
            "measured_step_time_ci": [0.240, 0.246]}


# ---------------------------------------------------------------- shape and mapping


def test_bucket_names_are_profile_py_s():
    assert set(trace_split.BUCKETS) == {n for n, _ in profile.BUCKETS} | {"other"}


def test_summarised_profile_loads(tmp_path):
    prof = trace_split.load(write(tmp_path, make_profile()))
    assert prof["_where"].endswith("prof.json")
    assert prof["buckets_s_per_step"]["collectives"] == pytest.approx(COLLECTIVES_S)


def test_mapping_sums_to_the_buckets_and_the_wall():
    t = trace_split.measured_split(make_profile(step_s=0.25))
    assert t.compute_s == pytest.approx(COMPUTE_S)
    assert t.optimizer_s == pytest.approx(OPTIMIZER_S)
    assert t.exposed_comm_s + t.overlapped_comm_s == pytest.approx(COLLECTIVES_S)
    assert t.total_s == pytest.approx(0.25)
    # a wall wide enough for every collective to be exposed: the rest is idle
    assert t.exposed_comm_s == pytest.approx(COLLECTIVES_S) and t.exposed_bound == "upper"
    assert t.idle_s == pytest.approx(0.25 - COMPUTE_S - OPTIMIZER_S - COLLECTIVES_S)


@pytest.mark.parametrize("step_s, union, exposed", [
    (0.25, None, COLLECTIVES_S),  # room for all of it: the bound is the collectives
    (0.20, None, 0.20 - COMPUTE_S - OPTIMIZER_S),  # the wall leaves less
    (0.15, None, 0.0),  # compute alone overruns the wall (several streams)
    (0.25, 0.19, 0.19 - COMPUTE_S - OPTIMIZER_S),  # from the kernel union, where recorded
])
def test_exposed_communication_is_bounded(step_s, union, exposed):
    extra = {} if union is None else {"busy_union_s": union}
    t = trace_split.measured_split(make_profile(step_s=step_s, **extra))
    assert t.exposed_comm_s == pytest.approx(exposed)
    assert 0.0 <= t.exposed_comm_s <= min(COLLECTIVES_S, max(0.0, step_s - COMPUTE_S
                                                                  - OPTIMIZER_S)) + 1e-12
    assert t.idle_s >= 0.0 and t.exposed_bound == ("upper" if union is None else "union")


# ---------------------------------------------------------------- bad files


def _set(path):
    """A mutation setting `path` (dotted) to a value, or deleting it with `...`."""
    def apply(prof, value):
        *parents, leaf = path.split(".")
        d = prof
        for p in parents:
            d = d[p]
        if value is ...:
            del d[leaf]
        else:
            d[leaf] = value
    return apply


@pytest.mark.parametrize("field, value", [
    ("busy_s", ...),
    ("layout.zero", ...),
    ("buckets_s_per_step.matmul", -0.1),
    ("buckets_s_per_step.warp_drive", 0.1),
    ("step_time_s", "0.25"),
    ("step_time_s", None),
    ("step_time_s", 0),
    ("active_steps", 0),
    ("active_steps", True),
    ("busy_s", 1.0),  # not the buckets' sum
    ("card", 4),
    ("top_kernels", {}),
    ("layout", "dp2 tp2"),
])
def test_bad_profile_names_file_and_field(tmp_path, field, value):
    prof = make_profile()
    _set(field)(prof, value)
    path = write(tmp_path, prof)
    with pytest.raises(RecordError) as err:
        trace_split.load(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(path) and f"{field} = " in msg


def test_not_json_is_one_line(tmp_path):
    path = write(tmp_path, "{not json")
    with pytest.raises(RecordError, match="not valid JSON") as err:
        trace_split.load(path)
    assert "\n" not in str(err.value) and path in str(err.value)


def test_committed_lists_the_profiles_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_split, "PROFILE_DIR", tmp_path / "profiles")
    assert trace_split.committed() == []
    (tmp_path / "profiles").mkdir()
    for name in ("b.json", "a.json", "notes.md"):
        (tmp_path / "profiles" / name).write_text("{}")
    assert [p.name for p in trace_split.committed()] == ["a.json", "b.json"]


# ---------------------------------------------------------------- pairing


def test_pair_picks_the_row_of_the_same_layout():
    rows = [row("fsdp-z3-mb8-c", dp=4, tp=1), row(), row("tp2-fsdp2-mb8", compile=False)]
    pp = trace_split.pair(make_profile(), rows)
    assert pp["config"] == "tp2-fsdp2-mb8-c"
    assert pp["predicted"] == {"compute": 0.12, "exposed_comm": 0.03, "idle": 0.0,
                               "optimizer": 0.004}
    assert pp["traced"].compute_s == pytest.approx(COMPUTE_S)
    assert pp["measured_step_s"] == 0.244


def test_pair_refuses_a_profile_of_another_card():
    with pytest.raises(RecordError, match="card = 'NVIDIA H100 80GB HBM3'"):
        trace_split.pair(make_profile(card="NVIDIA H100 80GB HBM3"), [row()])


def test_pair_refuses_a_layout_never_compared():
    with pytest.raises(RecordError, match="matches no compared config"):
        trace_split.pair(make_profile(), [row(tp=4, dp=1)])


def test_pair_asks_for_the_host_when_two_ran_the_layout():
    rows = [row(host="4 x NVIDIA H200"), row("tp2-fsdp2-mb8-c-8", host="8 x NVIDIA H200")]
    with pytest.raises(RecordError, match="pass host="):
        trace_split.pair(make_profile(), rows)
    assert trace_split.pair(make_profile(), rows, host="8 x NVIDIA H200")["config"] \
        == "tp2-fsdp2-mb8-c-8"
    # a profile that records its tag or host needs no host=
    assert trace_split.pair(make_profile(host_gpus=8), rows)["host"] == "8 x NVIDIA H200"
    assert trace_split.pair(make_profile(tag="tp2-fsdp2-mb8-c"), rows)["host"] \
        == "4 x NVIDIA H200"


def test_pair_with_the_committed_records():
    """A profile of page 4's TP 2 x FSDP 2 layout finds its row in `trainplan compare`: where
    the layout was measured again on that host, the series that stands, not the one it
    superseded."""
    rows = compare.compare(repredictions=False)["rows"]
    pp = trace_split.pair(make_profile(), rows)
    assert pp["host"] == "4 x NVIDIA H200"
    def layout(r):  # records older than fp8 (the fused loss) carry no precision (loss)
        return {"precision": "bf16", "loss": "standard", **r["layout"]}
    row = next(r for r in rows if r["config"] == pp["config"] and r["host"] == pp["host"])
    same = [r for r in rows if r["host"] == pp["host"] and layout(r) == layout(row)]
    assert len(same) >= 2 and any("superseded_by" in r for r in same)
    assert pp["config"] == next(r["config"] for r in same if "superseded_by" not in r)


def test_untraced_needs_a_compared_config():
    assert trace_split.untraced([row()], "tp2-fsdp2-mb8-c")["traced"] is None
    with pytest.raises(RecordError, match="not a compared config"):
        trace_split.untraced([row()], "tp8")


def test_values_and_sentence():
    pp = trace_split.pair(make_profile(), [row()])
    vals = trace_split.values(pp)
    assert vals["trace_exposed_comm_s"] == pytest.approx(COLLECTIVES_S)
    assert vals["trace_exposed_bound"] == "upper" and "at most" in trace_split.describe(pp)
    bare = trace_split.values(trace_split.untraced([row()], "tp2-fsdp2-mb8-c"))
    assert "trace_compute_s" not in bare and bare["trace_pred_compute_s"] == 0.12


# ---------------------------------------------------------------- figure


def _stacks(fig) -> list[list[tuple[float, float, float]]]:
    """(y, left, width) of each bar container's bars."""
    ax = fig.axes[0]
    return [[(b.get_y() + b.get_height() / 2, b.get_x(), b.get_width()) for b in c]
            for c in ax.containers]


def test_figure_stacks_predicted_and_traced_terms():
    pp = trace_split.pair(make_profile(step_s=0.2), [row()])  # some collectives hidden
    fig = figures.traced_split(pp)
    bars = [b for c in _stacks(fig) for b in c]
    assert len(bars) == 9  # four predicted terms, four traced, the hidden collectives
    ys = sorted({round(y, 3) for y, _, _ in bars}, reverse=True)
    predicted = [b for b in bars if round(b[0], 3) == ys[0]]
    traced = [b for b in bars if round(b[0], 3) == ys[1]]
    hidden = [b for b in bars if round(b[0], 3) == ys[2]]
    assert [w for _, _, w in hidden] == pytest.approx([pp["traced"].overlapped_comm_s])
    assert pp["traced"].overlapped_comm_s > 0
    assert [w for _, _, w in predicted] == pytest.approx([0.12, 0.03, 0.0, 0.004])
    assert [w for _, _, w in traced] == pytest.approx(
        [getattr(pp["traced"], f"{k}_s") for k in trace_split.TERMS])
    assert traced[-1][1] + traced[-1][2] == pytest.approx(pp["traced"].step_s)  # stacked
    line = fig.axes[0].lines[0]
    assert line.get_xdata()[0] == pytest.approx(0.244)  # the measured step
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "predicted", "traced", "hidden collectives"]


def test_figure_without_a_trace_draws_the_prediction_only():
    fig = figures.traced_split(trace_split.untraced([row()], "tp2-fsdp2-mb8-c"))
    assert len([b for c in _stacks(fig) for b in c]) == 4
    assert any("no profiler trace" in t.get_text() for t in fig.axes[0].texts)
    table = figures.traced_split_table(trace_split.pair(make_profile(), [row()]))
    assert list(table["predicted s"]) == ["0.120", "0.030", "0.000", "0.004"]


# ---------------------------------------------------------------- annotations


def test_drop_annotations_corrects_a_written_profile(tmp_path):
    """A JSON of profile.py before is_annotation: the listed annotations leave their buckets,
    busy_s and top_kernels, by exactly their seconds; a second pass changes nothing."""
    prof = make_profile()
    b = prof["buckets_s_per_step"]
    extra = {"ProfilerStep*": ("other", 0.2), "nccl:_all_gather_base": ("collectives", 0.05),
             "Optimizer.step#AdamW.step": ("optimizer", 0.003)}
    raw = {**prof, "buckets_s_per_step": {k: b[k] + sum(s for bk, s in extra.values() if bk == k)
                                          for k in b},
           "busy_s": prof["busy_s"] + 0.253,
           "top_kernels": [{"kernel": n, "bucket": bk, "s_per_step": s, "calls_per_step": 1.0}
                           for n, (bk, s) in extra.items()] + prof["top_kernels"]}
    fixed = trace_split.drop_annotations(raw)
    assert fixed["annotations_removed"] is True
    assert fixed["buckets_s_per_step"] == pytest.approx(b)
    assert fixed["busy_s"] == pytest.approx(prof["busy_s"])
    assert fixed["top_kernels"] == prof["top_kernels"]
    assert fixed["annotations_removed_s_per_step"] == {n: s for n, (_, s) in extra.items()}
    assert raw["busy_s"] == pytest.approx(prof["busy_s"] + 0.253)  # the input is left as is
    assert trace_split.drop_annotations(fixed) == fixed
    loaded = trace_split.load(write(tmp_path, raw))  # load applies it
    assert loaded["buckets_s_per_step"] == pytest.approx(b) and loaded["annotations_removed"]
    assert trace_split.measured_split(loaded).compute_s == pytest.approx(COMPUTE_S)


def test_committed_profiles_read_corrected():
    """The committed profiles carry no annotation and pair or are left out, never refused."""
    for path in trace_split.committed():
        prof = trace_split.load(path)
        assert prof["annotations_removed"]
        assert not any(profile.is_annotation(k["kernel"]) for k in prof["top_kernels"])
    rows = [row()]
    assert all(pp["card"] == "NVIDIA H200" for pp in trace_split.pair_committed(rows))


def test_the_profiled_wall_is_the_median_of_the_active_steps(tmp_path):
    """The last active step also runs the profiler's stop: a mean would count it."""
    prof = make_profile(step_s=0.4, step_times_s_profiled=[0.20, 0.21, 0.80])
    got = trace_split.load(write(tmp_path, prof))
    assert got["step_time_s"] == 0.21
    assert trace_split.measured_split(got).step_s == 0.21
    assert trace_split.load(write(tmp_path, make_profile(step_s=0.4)))["step_time_s"] == 0.4
    for bad in ([], "fast", [0.2, -1.0], [0.2, None]):
        with pytest.raises(RecordError, match="step_times_s_profiled"):
            trace_split.load(write(tmp_path, make_profile(step_times_s_profiled=bad)))


def test_committed_profiles_keep_their_profiled_steps():
    for path in trace_split.committed():
        prof = trace_split.load(path)
        steps = prof.get("step_times_s_profiled")
        assert steps is None or prof["step_time_s"] == sorted(steps)[len(steps) // 2]
