"""Trust per layout family: bands from the records, what a plan carries, the physical cap."""

from __future__ import annotations

import copy
import json
import os

import pytest
from tests.compare.test_compare import _on_host, _write, tp2_records

from trainplan.calibrate.store import load_gpu
from trainplan.cli import main
from trainplan.compare import accuracy as compare
from trainplan.compare import trust
from trainplan.cost.compute import matmul_ceiling_tokens_per_s, model_flops_per_token
from trainplan.cost.memory import NON_ALLOCATOR_GIB
from trainplan.plan.planner import plan
from trainplan.specs import load_cluster, load_model


def _row(family_layout: dict, error: float, card="NVIDIA H200", mem=0.01, **extra) -> dict:
    layout = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "dp": 1, **family_layout}
    return {"config": extra.get("config", f"c{error}"), "model": "llama-1.3b", "card": card,
            "host": f"4 x {card}", "layout": layout, "step_time_error": error,
            "memory_error": mem}


def test_a_family_band_spans_its_configs_and_needs_two_to_be_validated():
    fsdp = {"dp": 4, "zero": 3, "dp_shard": 4}
    rows = [_row(fsdp, -0.04, config="a"), _row(fsdp, 0.02, config="b"),
            _row(fsdp, 0.08, card="NVIDIA H100 80GB HBM3", config="c"),
            _row({"tp": 2}, 0.15, config="d"),
            {**_row(fsdp, 0.5, config="old"), "superseded_by": {"config": "a"}},
            {**_row(fsdp, 0.0, config="none"), "step_time_error": None}]
    bands = trust.family_bands({"rows": rows})
    fs = next(b for b in bands if b["family"] == "FSDP")
    assert fs["card_class"] == "Hopper" and fs["configs"] == 3  # H100 and H200 pooled
    assert (fs["low"], fs["high"]) == (pytest.approx(0.96), pytest.approx(1.08))
    assert fs["validated"] and fs["within_targets"]
    assert fs["cards"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    tp = next(b for b in bands if b["family"] == "TP")
    assert not tp["validated"] and not tp["within_targets"]  # one config, 15% off

    got = trust.band_for(bands, "FSDP", "h100-sxm")
    assert got["validated"] and got["configs"] == 3 and "why" not in got
    one = trust.band_for(bands, "TP", "h200-sxm")
    assert not one["validated"] and "1 TP config" in one["why"]
    never = trust.band_for(bands, "PP + CP + ZeRO-1", "h100-sxm")
    assert never == {"family": "PP + CP + ZeRO-1", "card_class": "Hopper", "validated": False,
                     "configs": 0, "why": "no PP + CP + ZeRO-1 layout has been measured on "
                                          "Hopper GPUs"}
    assert not trust.band_for(bands, "FSDP", "a100-80gb")["validated"]  # another class


def test_a_band_spans_each_config_s_measurement_interval():
    """Two configs measured at the same ratio still give a band as wide as their intervals."""
    hsdp = {"dp": 4, "zero": 3, "dp_shard": 2}
    rows = [{**_row(hsdp, -0.016, config=c), "predicted_step_time_s": 0.157,
             "measured_step_time_ci": [0.155, 0.164]} for c in ("a", "b")]
    (band,) = trust.family_bands({"rows": rows})
    assert band["median"] == pytest.approx(0.984)
    assert band["low"] == pytest.approx(0.157 / 0.164) and band["high"] == pytest.approx(
        0.157 / 0.155)
    assert trust.factor_span(_row(hsdp, 0.05)) == (1.05, 1.05)  # no interval: the point


def test_memory_outside_the_targets_leaves_a_family_validated_but_not_within():
    dp = {"dp": 4}
    bands = trust.family_bands({"rows": [_row(dp, 0.01, config="a"),
                                         _row(dp, -0.02, mem=-0.15, config="b")]})
    assert bands[0]["validated"] and not bands[0]["within_targets"]


def test_the_ceiling_is_the_dense_matmul_rate_and_caps_the_band():
    m, gpu = load_model("llama-13b"), load_gpu("h100-sxm")
    ceiling = matmul_ceiling_tokens_per_s(m, gpu, 4096)
    assert ceiling * model_flops_per_token(m, 4096) == pytest.approx(
        gpu.bf16_tflops * 1e12 * gpu.matmul_efficiency)
    assert trust.capped(1000.0, 1.5, 1200.0) == 1200.0
    assert trust.capped(1000.0, 0.9, 1200.0) == 900.0


def test_plans_carry_their_familys_band_from_the_suites_records(tmp_path):
    """A records file with the committed TP 2 series measured on two 4-GPU days: a TP plan
    of the 1.3B model on H200 is validated with that band, capped; an FSDP plan is not."""
    pred, meas = tp2_records()
    pred2 = copy.deepcopy(pred)
    pred2["config"]["tag"] = "tp2-again"
    again = [{**m, "tag": "tp2-again"} for m in _on_host(meas, 2, 0.9, "2026-11-28")]
    path = _write(tmp_path / "general-x.jsonl", [pred, *meas, pred2, *again])
    m, gpu = load_model("llama-1.3b"), load_gpu("h200-sxm")

    def planned(**pins):
        out = plan(m, gpu, load_cluster("dgx-h100"), gpus=2, seq_len=2048,
                   global_batch_tokens=16 * 2048, pins=pins, top=1)
        return trust.validation(out, m, gpu, paths=[path])["plans"][0]

    tp = planned(tp=2)
    v = tp["validation"]
    assert v["validated"] and v["family"] == "TP" and v["configs"] == 2
    rate = v["tokens_per_s_per_gpu"]
    assert rate["high"] <= rate["ceiling"]
    assert rate["low"] == pytest.approx(min(tp["tokens_per_s_per_gpu"] * v["low"],
                                            rate["ceiling"]))
    fsdp = planned(dp=2, zero=3)["validation"]
    assert fsdp["validated"] is False and "tokens_per_s_per_gpu" not in fsdp


def test_suite_bands_follow_the_files_on_disk(tmp_path):
    """Bands are worked out once per set of files, and again when a file changes: a second
    series of the config written into the same file makes the band of two configs; the
    answer is a copy (a caller's edit does not reach the next)."""
    pred, meas = tp2_records()
    path = _write(tmp_path / "general-x.jsonl", [pred, *meas])
    first = trust.suite_bands([path])
    assert [(b["family"], b["configs"]) for b in first] == [("TP", 1)]
    first[0]["configs"] = 99
    assert trust.suite_bands([path])[0]["configs"] == 1
    pred2 = copy.deepcopy(pred)
    pred2["config"]["tag"] = "tp2-again"
    again = [{**m, "tag": "tp2-again"} for m in _on_host(meas, 2, 0.9, "2026-11-28")]
    _write(tmp_path / "general-x.jsonl", [pred, *meas, pred2, *again])
    assert [(b["family"], b["configs"]) for b in trust.suite_bands([path])] == [("TP", 2)]


def test_suite_bands_see_a_same_size_rewrite_with_its_time_set_back(tmp_path):
    """A rewrite that keeps the size and sets the modification time back (cp -p, rsync -t)
    is still another file: the prediction doubled doubles the band's low end."""
    pred, meas = tp2_records()
    fast, slow = copy.deepcopy(pred), copy.deepcopy(pred)
    fast["predicted"]["step_time_s"], slow["predicted"]["step_time_s"] = 0.1, 0.2
    path = _write(tmp_path / "general-x.jsonl", [fast, *meas])
    low = trust.suite_bands([path])[0]["low"]
    before = os.stat(path)
    _write(tmp_path / "general-x.jsonl", [slow, *meas])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    assert trust.suite_bands([path])[0]["low"] == pytest.approx(2 * low)


def test_compare_reports_families_and_the_cli_prints_them(tmp_path, capsys):
    pred, meas = tp2_records()
    path = _write(tmp_path / "r.jsonl", [pred, *meas])
    bands = trust.family_bands(compare.compare([path], repredictions=False))
    assert [(b["family"], b["configs"]) for b in bands] == [("TP", 1)]
    assert main(["compare", "--records", path, "--no-repredict", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["families"] == json.loads(json.dumps(bands))
    assert main(["compare", "--records", path, "--no-repredict"]) == 0
    text = capsys.readouterr().out
    assert "per layout family" in text and "not validated (1 config)" in text


def test_plan_names_each_plans_trust(capsys):
    assert main(["plan", "--model", "llama-13b", "--gpu", "h100-sxm", "--gpus", "32",
                 "--top", "3", "--cp", "4"]) == 0
    text = capsys.readouterr().out
    assert "trust" in text.splitlines()[1] and "not validated" in text  # no CP run anywhere


def test_a_memory_band_is_its_familys_where_measured_twice_else_the_class_pooled():
    """The upper end of measured over predicted peak memory: the family's own over two or more
    configs, else the largest of every family on the card class, never below 1; none on a
    class with no memory measured. A plan fits with margin when its prediction times that
    upper end is within the card less what lives outside the allocator."""
    fsdp, tp = {"dp": 4, "zero": 3, "dp_shard": 4}, {"tp": 2}
    rows = [_row(fsdp, 0.0, mem=-0.1, config="a"), _row(fsdp, 0.0, mem=0.05, config="b"),
            _row(tp, 0.0, mem=-0.2, config="c"),
            _row({"dp": 2}, 0.0, mem=0.1, config="d"), _row({"dp": 2}, 0.0, mem=0.2, config="e")]
    bands = trust.family_bands({"rows": rows})
    own = trust.memory_band(bands, "FSDP", "h100-sxm")
    assert own["source"] == "family" and own["factor"] == pytest.approx(1 / 0.9)
    assert own["configs"] == 2 and own["card_class"] == "Hopper"
    pooled = trust.memory_band(bands, "TP", "h200-sxm")  # one TP config: pooled
    assert pooled["source"] == "pooled" and pooled["factor"] == pytest.approx(1 / 0.8)
    assert pooled["configs"] == 5
    assert trust.memory_band(bands, "DDP", "h100-sxm")["factor"] == 1.0  # over-predicted
    assert trust.memory_band(bands, "FSDP", "a100-80gb") == {
        "factor": None, "source": "none", "configs": 0, "card_class": "Ampere"}

    usable = 80.0 - NON_ALLOCATOR_GIB
    edge = usable / own["factor"]
    fits = trust.memory_margin(own, edge * 0.999, 80.0)
    assert fits["fits"] and fits["usable_gib"] == usable
    over = trust.memory_margin(own, edge * 1.001, 80.0)
    assert over["fits"] is False
    assert over["upper_gib"] == pytest.approx(edge * 1.001 * own["factor"])
    assert trust.memory_margin(trust.memory_band(bands, "FSDP", "a100-80gb"), 70.0, 80.0)[
        "fits"] is None


def test_plan_json_says_whether_each_plan_fits_with_its_memory_band(capsys):
    assert main(["plan", "--model", "llama-13b", "--gpu", "h100-sxm", "--gpus", "32",
                 "--top", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for p in out["plans"]:
        m = p["validation"]["memory"]
        assert m["upper_gib"] == pytest.approx(p["memory_gib"]["total"] * m["factor"])
        assert p["memory_fits_band"] == (m["upper_gib"] <= m["usable_gib"])
    d = out["decision"]
    if d["passed_over"]:  # the plans ahead of the decision do not fit with their band
        assert not any(p["memory_fits_band"] for p in out["plans"][:d["rank"] - 1])
    assert main(["plan", "--model", "llama-13b", "--gpu", "h100-sxm", "--gpus", "32",
                 "--top", "8"]) == 0
    text = capsys.readouterr().out
    rows = text.splitlines()[2:10]
    for p, line in zip(out["plans"], rows, strict=True):  # the band column: "!" when over
        assert (f"{p['validation']['memory']['upper_gib']:.1f}!" in line) == (
            not p["memory_fits_band"])
    assert f"decision: #{d['rank']} {d['plan']['strategy']}" in text
    assert (d["plan"]["memory_fits_band"] is False) == ("no plan fits" in text)


def test_a_config_s_span_carries_its_launches_spread():
    """Predicted 0.165 s, the series measured 0.150 s (+10%); launches of 0.12 s and 0.16 s
    widen the span to the point factor times 0.150 over each."""
    row = {**_row({"dp": 4, "zero": 2, "dp_shard": 4}, 0.10), "predicted_step_time_s": 0.165,
           "measured_step_time_s": 0.150, "measured_step_time_ci": [0.149, 0.151]}
    lo, hi = trust.factor_span(row, [0.12, 0.16])
    assert (lo, hi) == (pytest.approx(1.1 * 0.150 / 0.16), pytest.approx(1.1 * 0.150 / 0.12))
    assert trust.factor_span(row) == (pytest.approx(0.165 / 0.151), pytest.approx(0.165 / 0.149))


def test_a_family_band_takes_the_spread_of_every_series_of_a_config_on_its_host():
    """The superseded series' error is left out, its launches are not (the spread is the
    host's); another host's launches of the same config, and another config's, stay apart."""
    z2 = {"dp": 4, "zero": 2, "dp_shard": 4}

    def row(config, error, measured, launches, host="4 x NVIDIA H200", **extra):
        return {**_row(z2, error, config=config), "host": host, "measured_step_time_s": measured,
                "launch_step_time_s": launches, **extra}

    rows = [row("a", 0.10, 0.150, [0.148, 0.152]),
            row("a", 0.40, 0.120, [0.121, 0.119], superseded_by={"config": "a"}),
            row("a", 0.0, 0.300, [0.30, 0.60], host="2 x NVIDIA H200", step_time_error=None),
            row("b", -0.02, 0.250, [0.25, 0.255])]
    (band,) = trust.family_bands({"rows": rows})
    assert band["configs"] == 2  # the superseded series and the error-less row are not counted
    assert band["high"] == pytest.approx(1.1 * 0.150 / 0.119)
    assert band["low"] == pytest.approx(0.98 * 0.250 / 0.255)
    assert band["launch_spread"] == pytest.approx(0.152 / 0.119 - 1)
    assert band["launch_spread_config"] == "a"
    assert trust.band_for([band], "ZeRO-2", "h200-sxm")["launch_spread"] == band["launch_spread"]
    (once,) = trust.family_bands({"rows": [row("c", 0.05, 0.2, [0.2])]})
    assert once["launch_spread"] is None  # no config ran twice


def test_compare_rows_carry_each_launch_s_median(tmp_path):
    pred, meas = tp2_records()
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas])], repredictions=False)
    (row,) = out["rows"]
    assert row["launch_step_time_s"] == [m["step_time_s"] for m in meas]
