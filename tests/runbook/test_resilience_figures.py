"""Page-5 figures of the checkpoint benchmark and the fault matrix, from small synthetic records."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from trainplan.records import schema as records  # noqa: E402
from trainplan.runbook.figures import resilience as fig  # noqa: E402


def _record(device="cuda", sync_stall=14.0, async_stall=0.3, raw=2.0, p_sync=1.6, p_async=1.2):
    saves = [{"mode": m, "step": s, "stall_s": st, "persist_s": 10.0, "bytes": 16_000_000_000,
              "commit_in_loop_s": 0.0, "committed": True}
             for m, s, st in (("sync", 8, sync_stall), ("sync", 13, sync_stall),
                              ("async", 18, 4.0), ("async", 23, async_stall))]
    rec = {"kind": "checkpoint", "recorded_at": "2026-11-26T00:00:00+00:00",
           "provenance": {"date": "2026-11-26T00:00:00+00:00"}, "model": "llama-1.3b",
           "layout": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 2, "micro_batch": 1,
                      "grad_accum": 1, "recompute": "none", "compile": False},
           "ranks": 2, "device": device, "card": "NVIDIA H100 80GB HBM3" if device == "cuda"
           else "cpu", "run_id": "t", "raw_write": {"gbps": raw}, "saves": saves,
           "restart": {"restart_to_first_step_s": 5.0},
           "summary": {"raw_write_gbps": raw, "checkpoint_bytes": 16e9, "sync_stall_s": sync_stall,
                       "async_stall_s": async_stall, "async_first_stall_s": 4.0,
                       "persist_gbps_sync": p_sync, "persist_gbps_async": p_async,
                       "persist_vs_raw_sync": p_sync / raw, "persist_vs_raw_async": p_async / raw,
                       "restart_to_first_step_s": 5.0}}
    return records.validate(rec)


def test_without_gpu_records_the_figure_says_so_and_the_verdict_too():
    for recs in ([], [_record(device="cpu")]):
        figure = fig.checkpoint_bench_figure(recs)
        assert "no GPU checkpoint benchmark" in figure.axes[0].texts[0].get_text()
        assert fig.checkpoint_verdict(recs).startswith("No GPU checkpoint")
        assert "not yet recorded" in fig.checkpoint_verdict_short(recs)
        assert fig.checkpoint_cards(recs) == "no GPU launch recorded yet"
        assert fig.checkpoint_targets_table(recs).empty
    assert fig.checkpoint_bench_table([]).shape == (11, 0)


def test_figure_draws_each_modes_stall_and_persist_against_raw():
    recs = [_record(), _record(sync_stall=20.0, async_stall=0.5, raw=1.5, p_sync=1.3,
                               p_async=1.0), _record(device="cpu")]
    figure = fig.checkpoint_bench_figure(recs)
    ax_stall, ax_persist = figure.axes
    heights = [round(p.get_height(), 3) for p in ax_stall.patches]
    assert heights == [14.0, 20.0, 0.3, 0.5]  # sync bars of both GPU launches, then async
    assert [round(p.get_height(), 3) for p in ax_persist.patches] == [2.0, 1.5, 1.6, 1.3,
                                                                      1.2, 1.0]
    dashed = [line.get_ydata()[0] for line in ax_persist.lines]
    assert dashed == pytest.approx([0.8 * 2.0, 0.8 * 1.5])  # the 80%-of-raw target
    assert len(ax_stall.get_xticklabels()) == 2 and "2 x H100" in \
        ax_stall.get_xticklabels()[0].get_text()


def test_table_reads_the_summary():
    table = fig.checkpoint_bench_table([_record(), _record(device="cpu")])
    assert table.shape == (11, 1)
    col = table.iloc[:, 0]
    assert col["stall, asynchronous (s)"] == "0.30" and col["persist / raw, synchronous"] == "80%"


def test_targets_say_which_is_met_against_the_newest_gpu_launch():
    old = _record(async_stall=2.0, p_async=1.9)
    new = _record()  # stall 0.3 s: met; persist 60% async, 80% sync
    new["recorded_at"] = "2026-11-27T00:00:00+00:00"
    table = fig.checkpoint_targets_table([new, old, _record(device="cpu")])
    assert table["result"].tolist() == ["met", "not met", "met"]
    assert table.loc["persist, asynchronous save", "measured"] == "60% (1.20 of 2.00 GB/s)"
    assert [c.met for c in fig.checkpoint_targets(old)] == [False, True, True]
    assert fig.checkpoint_cards([old, new]) == "NVIDIA H100 80GB HBM3 x 2"


def test_verdict_names_the_card_the_results_and_why_persist_falls_short():
    rec = _record()
    rec["saves"][-1]["phases"] = {"write_s": 7.5, "hash_s": 2.5}
    text = fig.checkpoint_verdict([rec])
    assert text.startswith("On NVIDIA H100 80GB HBM3 x 2 (llama-1.3b, ZeRO-2, 16.0 GB a save)")
    assert "stall target is **met**" in text and "persist target" in text
    assert "is **not met**: a save is durable at 60% (1.20 of 2.00 GB/s)" in text
    assert "writing took 7.50 s and hashing then took 2.50 s more (25% of" in text
    assert "first step after 5.0 s" in text
    short = fig.checkpoint_verdict_short([rec])
    assert "meets the stall target (0.30 s) and misses the persist target (60%" in short


def test_verdict_gives_no_reason_when_persist_meets_its_target():
    text = fig.checkpoint_verdict([_record(p_async=1.8)])
    assert "target (at least 80% of raw write) is **met**" in text and "Why" not in text


def test_checkpoint_records_skip_missing_files_and_refuse_a_malformed_one(tmp_path):
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    records.append(good, _record())
    assert len(fig.checkpoint_records([good, tmp_path / "missing.jsonl"])) == 1
    broken = _record()
    del broken["summary"]["async_stall_s"]
    bad.write_text(json.dumps(broken) + "\n")
    with pytest.raises(records.RecordError, match=r"b.jsonl:1: .*'async_stall_s'"):
        fig.checkpoint_records(bad)


def test_fault_matrix_table_and_caption(tmp_path):
    matrix = {"date": "2026-11-26T04:50:00+00:00", "commit": "0123456789abcdef",
              "torch": "2.13.0", "counts": {"passed": 1, "failed": 1, "error": 0, "skipped": 0},
              "rows": [{"scenario": "a hung rank", "guarantee": "timeout ends the step",
                        "test": "tests/faults/test_restarts.py::test_hung", "outcome": "passed",
                        "duration_s": 20.04},
                       {"scenario": "x", "guarantee": "y", "test": "t.py::test_x",
                        "outcome": "failed", "duration_s": 1.0}]}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(matrix))
    table = fig.fault_matrix_table(path)
    assert list(table.columns) == ["scenario", "guarantee", "result", "test"]
    assert table.iloc[0].tolist() == ["a hung rank", "timeout ends the step", "passed (20.0 s)",
                                      "test_hung"]
    assert table.iloc[1]["result"] == "failed (1.0 s)"
    assert fig.fault_matrix_caption(matrix) == ("1 of 2 fault tests passed on 2026-11-26 at "
                                                 "commit 0123456789 (torch 2.13.0, CPU, gloo, "
                                                 "real torchrun)")


# ---------------------------------------------------------------- page 5's checkpoint table


@pytest.mark.parametrize("gpus", [32, 60_000, 64_000, 73_000])
def test_the_checkpoint_table_never_shows_a_positive_number_as_zero(gpus):
    """Between about 60,000 and 73,000 GPUs (the state split over all of them) the chosen
    interval is a few tenths of a second, 0.005-0.007 min: it keeps two digits."""
    from trainplan.launch import job
    from trainplan.resilience.checkpoint import digits
    from trainplan.specs import load_model

    plans = job.checkpoint_plans(load_model("llama-13b"), gpus, 8,
                                 {"tp": 1, "pp": 1, "dp_shard": gpus, "zero": 3})
    table = fig.checkpoint_table(plans)
    for case, plan in plans.items():
        column = table[case]
        assert column["chosen interval (min)"] == digits(plan.interval_min)
        assert column["job MTBF (hours)"] == digits(plan.job_mtbf_hours, 0)
        assert column["effective training time ratio"] == f"{plan.ettr:.2%}"
        for label, cell in column.items():
            if label != "interval set by":
                assert float(cell.rstrip("%").replace(",", "")) > 0, (case, label, cell)
    if gpus >= 60_000:
        assert plans["conservative"].interval_min < 0.05  # "{:,.1f}" would show 0.0
