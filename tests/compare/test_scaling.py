"""Weak-scaling efficiency from `trainplan compare` rows (`trainplan.compare.scaling`)."""

from __future__ import annotations

import pytest

from trainplan.compare import scaling


def row(config, gpus, zero, rate, tp=1, launches=3, mb=8, card="NVIDIA H100 80GB HBM3"):
    lay = {"dp": gpus // tp, "tp": tp, "pp": 1, "cp": 1, "ep": 1, "zero": zero,
           "micro_batch": mb, "grad_accum": 1, "recompute": "none", "compile": True}
    return {"config": config, "model": "llama-1.3b", "impl": "trainplan", "card": card,
            "gpus": gpus, "layout": lay, "launches": launches,
            "measured_tokens_per_s_per_gpu": rate,
            "measured_tokens_per_s_per_gpu_ci": [rate * 0.99, rate * 1.01]}


ROWS = [row("1gpu-mb8-c", 1, 0, 60000.0),
        row("fsdp-z2-mb8-c-2gpu", 2, 2, 59000.0), row("fsdp-z2-mb8-c", 4, 2, 57600.0),
        row("fsdp-z3-mb8-c-2gpu", 2, 3, 58000.0), row("fsdp-z3-mb8-c", 4, 3, 54000.0),
        row("tp4-mb8-c", 4, 0, 40000.0, tp=4),  # not data parallel: in no series
        row("fsdp-z2-mb16-c", 4, 2, 64000.0, mb=16)]  # no 1-GPU point at mb 16: no series


def test_efficiency_is_the_rate_over_the_one_gpu_rate():
    out = scaling.weak_scaling(ROWS)
    by_zero = {s["zero"]: s for s in out["series"]}
    assert sorted(by_zero) == [2, 3]
    z2 = by_zero[2]
    assert [p["gpus"] for p in z2["points"]] == [1, 2, 4]
    assert [p["efficiency"] for p in z2["points"]] == pytest.approx([1.0, 59 / 60, 0.96])
    lo, hi = z2["points"][-1]["efficiency_ci"]
    assert lo == pytest.approx(57600 * 0.99 / (60000 * 1.01))
    assert hi == pytest.approx(57600 * 1.01 / (60000 * 0.99))
    assert z2["meets_target"] and not by_zero[3]["meets_target"]  # 0.90 < 0.95
    assert z2["baseline"] == "1gpu-mb8-c" and z2["baseline_note"]
    assert "ZeRO-2" in z2["name"] and "mb 8" in z2["name"]


def test_same_zero_baseline_wins_and_cards_do_not_mix():
    rows = ROWS + [row("1gpu-z2", 1, 2, 58000.0),
                   row("h200-4", 4, 2, 70000.0, card="NVIDIA H200")]
    out = scaling.weak_scaling(rows)
    z2 = next(s for s in out["series"] if s["zero"] == 2 and "H100" in s["card"])
    assert z2["baseline"] == "1gpu-z2" and z2["baseline_note"] is None
    assert not any("H200" in s["card"] for s in out["series"])  # no 1-GPU H200 point


def test_more_launches_win_at_one_gpu_count():
    rows = ROWS + [row("fsdp-z2-again", 4, 2, 30000.0, launches=1)]
    z2 = next(s for s in scaling.weak_scaling(rows)["series"] if s["zero"] == 2)
    assert z2["points"][-1]["config"] == "fsdp-z2-mb8-c"


def test_format_and_figure():
    out = scaling.weak_scaling(ROWS)
    text = scaling.format_scaling(out)
    assert "96.0%" in text and "misses the target" in text
    assert "no data-parallel" in scaling.format_scaling(scaling.weak_scaling([]))
    from trainplan.runbook.figures.validation import weak_scaling_figure

    fig = weak_scaling_figure(out)
    assert len(fig.axes[0].lines) >= 3


def test_hsdp_is_its_own_series_not_the_zero3_point():
    """HSDP 2 x 2 (ZeRO-3 within groups of 2, replicated twice) is not FSDP2 ZeRO-3 over
    all four GPUs: it starts its own series, named as such."""
    hsdp = row("p-hsdp2x2-mb8", 4, 3, 50000.0)
    hsdp["layout"]["dp_shard"] = 2
    out = scaling.weak_scaling(ROWS + [hsdp])
    z3 = [s for s in out["series"] if s["zero"] == 3]
    assert sorted((s["hsdp_shard"] or 0) for s in z3) == [0, 2]
    split = next(s for s in z3 if s["hsdp_shard"] == 2)
    plain = next(s for s in z3 if s["hsdp_shard"] is None)
    assert [p["config"] for p in split["points"]] == ["1gpu-mb8-c", "p-hsdp2x2-mb8"]
    assert plain["points"][-1]["config"] == "fsdp-z3-mb8-c"
    assert split["name"].startswith("HSDP 2 x 2") and "HSDP" not in plain["name"]
