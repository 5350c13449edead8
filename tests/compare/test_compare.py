"""`trainplan compare`: the contract on the committed records, no peeking, bad record files."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainplan.cli import main
from trainplan.compare import accuracy as compare
from trainplan.compare import matching
from trainplan.compare import views as compare_views
from trainplan.loader import quote
from trainplan.specs import SLICE

ROOT = Path(__file__).resolve().parents[2]
PRED = ROOT / "data/measurements/proxy-h200x2-20261126-predictions.jsonl"
MEAS = ROOT / "data/measurements/proxy-h200x2-20261126-measurements.jsonl"
ROW_KEYS = {"config", "predicted_step_time_s", "measured_step_time_s", "measured_step_time_ci",
            "step_time_error", "predicted_memory_gib", "measured_memory_gib", "memory_error",
            "dominant_term", "launches", "flagged", "predicted_split_s"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tp2_records() -> tuple[dict, list[dict]]:
    """The committed TP 2 prediction (first series) and its three measurements."""
    pred = next(p for p in _lines(PRED) if p["config"]["tag"] == "tp2-mb8-c")
    meas = [m for m in _lines(MEAS) if m["layout"]["tp"] == 2]
    assert len(meas) == 3
    return pred, meas


def _write(path: Path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


@pytest.fixture(scope="module")
def committed():
    return compare.compare(repredictions=True)


def test_contract_on_committed_records(committed, capsys):
    out = committed
    assert out["configs"] >= 10 and len(out["rows"]) >= 10
    for key in ("step_time_error", "memory_error"):
        assert set(out[key]) >= {"median", "max"}
        assert 0 <= out[key]["median"] <= out[key]["max"]
    for row in out["rows"]:
        assert ROW_KEYS <= set(row)
        low, high = row["measured_step_time_ci"]
        assert low <= row["measured_step_time_s"] <= high
        assert row["flagged"] == (row["launches"] < matching.MIN_LAUNCHES)
    assert out["refused"] == []
    from trainplan.calibrate import store as calibration
    head = next(r for r in out["rows"] if r["host"] == out["headline_host"])
    preset = calibration.card_preset(head["card"])  # the headline host's card, calibrated
    assert out["repredicted"]["calibration"] == calibration.load(preset)["label"]
    assert main(["compare", "--json", "--no-repredict"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["configs"] == out["configs"] and cli["step_time_error"] == out["step_time_error"]
    assert "repredicted" not in cli
    # the headline is the headline host's; every host, pooled, is under all_hosts
    head = out["hosts"][out["headline_host"]]
    assert out["configs"] == head["configs"] and out["step_time_error"] == head["step_time_error"]
    assert out["all_hosts"]["configs"] == sum(h["configs"] for h in out["hosts"].values())
    assert out["all_hosts"]["configs"] >= out["configs"] and out["headline_rule"]


def test_headline_uses_only_the_recorded_predictions(committed):
    for row in committed["rows"]:
        pred = next(p for p in _lines(Path(row["prediction"].rsplit(":", 1)[0]))
                    if p["recorded_at"] == row["predicted_at"])
        assert row["predicted_step_time_s"] == pred["predicted"]["step_time_s"]
        assert row["predicted_at"] < row["first_measured_at"]


def test_prediction_after_measurement_is_refused(tmp_path):
    pred, meas = tp2_records()
    late = copy.deepcopy(pred)
    late["recorded_at"] = "2026-11-26T03:00:00+00:00"  # after every launch
    out = compare.compare([_write(tmp_path / "r.jsonl", [late, *meas])], repredictions=False)
    assert out["configs"] == 0 and len(out["rows"]) == 1
    assert out["rows"][0]["predicted_step_time_s"] is None
    assert out["refused"][0]["predicted_at"] == late["recorded_at"]
    assert out["step_time_error"]["median"] is None
    # the same prediction stamped before the first launch is compared
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, late, *meas])],
                          repredictions=False)
    assert out["configs"] == 1 and len(out["refused"]) == 1
    assert out["rows"][0]["predicted_at"] == pred["recorded_at"]


def test_prediction_between_launches_is_refused(tmp_path):
    pred, meas = tp2_records()
    pred["recorded_at"] = meas[1]["recorded_at"]
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas])], repredictions=False)
    assert out["configs"] == 0 and len(out["refused"]) == 1


def test_other_config_does_not_match(tmp_path):
    pred, meas = tp2_records()
    pred["layout"]["compile"] = False
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas])], repredictions=False)
    assert out["configs"] == 0 and out["refused"] == []
    assert out["predicted_not_measured"] == ["tp2-mb8-c on NVIDIA H200"]


def test_other_implementation_does_not_match(tmp_path):
    pred, meas = tp2_records()
    pred["config"]["impl"] = "hf-baseline"
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas])], repredictions=False)
    assert out["configs"] == 0


def test_few_launches_are_flagged_not_dropped(tmp_path):
    pred, meas = tp2_records()
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, meas[0]])], repredictions=False)
    assert out["configs"] == 1 and out["rows"][0]["flagged"] and out["flagged_configs"] == 1


@pytest.mark.parametrize("mutate, match", [
    (lambda lines: lines[:1] + ["{not json"] + lines[1:], "not valid JSON"),
    (lambda lines: [json.dumps({k: v for k, v in json.loads(lines[0]).items()
                                if k != "step_time_s"})], "missing field 'step_time_s'"),
    (lambda lines: lines + [""], "empty line"),
])
def test_bad_record_file_is_one_line_exit_2(tmp_path, capsys, mutate, match):
    lines = MEAS.read_text().splitlines()
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(mutate(lines)) + "\n")
    assert main(["compare", "--records", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert match in captured.err and "bad.jsonl" in captured.err


def test_missing_file_is_one_line_exit_2(tmp_path, capsys):
    assert main(["compare", "--records", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_records_file_given_twice_is_refused(tmp_path, capsys):
    """The same file twice (as given, spelled another way, or through a link) would count
    every launch twice: narrower intervals, other flagged configs. One line, exit 2."""
    link = tmp_path / "link.jsonl"
    link.symlink_to(MEAS)
    for second in (MEAS, f"{ROOT}/data/./{MEAS.relative_to(ROOT / 'data')}", link):
        argv = ["compare", "--records", str(PRED), str(MEAS), str(second), "--no-repredict",
                "--json"]
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error: ")
        assert f"--records {quote(str(MEAS))} is given twice (then as --records " \
            f"{quote(str(second))})" in err
        assert "give each file once" in err


def test_leave_one_out_is_reported_apart(committed):
    fit = committed["end_to_end_fit"]
    assert "leave-one-out" in fit["method"] and fit["n"] == committed["configs"]
    assert committed["step_time_error"] != fit  # never replaces the headline


def test_throughput_band_spans_the_errors(committed):
    band = compare_views.throughput_band(committed)
    # every host's configs pooled, the layer slices with them: they are at the target's width
    assert band["n"] == committed["all_hosts"]["configs"] + committed["width_check"]["configs"]
    current = [r for r in committed["rows"] if "superseded_by" not in r]
    factors = [1 + r["step_time_error"] for r in current]
    assert (band["low"], band["high"]) == (min(factors), max(factors))
    assert band["low"] <= band["median"] <= band["high"]
    assert f"on up to {max(r['gpus'] for r in current)} GPUs of " in band["basis"]


def test_one_config_on_two_kinds_of_host_is_two_rows_largest_host_first(tmp_path):
    """The 2-GPU TP config measured again on a 4-GPU host: its launches are not pooled with
    the 2-GPU host's, and the 4-GPU host heads `hosts` (the runbook's headline)."""
    pred, meas = tp2_records()
    other = copy.deepcopy(meas)
    for m in other:
        m["provenance"]["gpu_count"] = 4
        m["recorded_at"] = m["recorded_at"].replace("2026-11-26", "2026-11-27")
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, *other])],
                          repredictions=False)
    assert [r["host"] for r in out["rows"]] == ["2 x NVIDIA H200", "4 x NVIDIA H200"]
    assert [r["launches"] for r in out["rows"]] == [3, 3]
    assert list(out["hosts"]) == ["4 x NVIDIA H200", "2 x NVIDIA H200"]
    assert out["headline_host"] == "4 x NVIDIA H200" and out["hosts"][out["headline_host"]][
        "configs"] == 1


def test_tagged_configs_of_one_layout_are_separate_rows(tmp_path):
    """Two suite configs with one layout (say, different loader workers) stay apart when
    the records name their tags, and each takes its own prediction."""
    pred, meas = tp2_records()
    other = copy.deepcopy(pred)
    other["config"]["tag"] = "tp2-mb8-c-nw0"
    recs = [pred, other]
    for m, tag in zip(meas, ("tp2-mb8-c", "tp2-mb8-c", "tp2-mb8-c-nw0"), strict=True):
        recs.append({**m, "tag": tag})
    out = compare.compare([_write(tmp_path / "r.jsonl", recs)], repredictions=False)
    rows = {r["config"]: r["launches"] for r in out["rows"]}
    assert rows == {"tp2-mb8-c": 2, "tp2-mb8-c-nw0": 1}


def test_untagged_records_still_pool_by_layout(tmp_path):
    pred, meas = tp2_records()
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas])], repredictions=False)
    assert [(r["config"], r["launches"]) for r in out["rows"]] == [("tp2-mb8-c", 3)]


def test_prediction_of_a_rerun_is_not_refused_and_the_first_stands(tmp_path):
    """Measured again in a later run: that run's own prediction came before its launches,
    so it is not refused; the launches pool and the first prediction is the one compared.
    Recorded in the middle of its run, it would be refused."""
    pred, meas = tp2_records()
    again = {**copy.deepcopy(pred), "run_id": "rerun",
             "recorded_at": "2026-11-26T09:00:00+00:00"}
    later = {**copy.deepcopy(meas[0]), "run_id": "rerun",
             "recorded_at": "2026-11-26T09:01:00+00:00"}
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, again, *meas, later])],
                          repredictions=False)
    assert out["refused"] == [] and out["rows"][0]["launches"] == 4
    assert out["rows"][0]["predicted_at"] == pred["recorded_at"]
    again["recorded_at"] = "2026-11-26T09:02:00+00:00"
    late = {**copy.deepcopy(later), "recorded_at": "2026-11-26T09:03:00+00:00"}
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, again, *meas, later, late])],
                          repredictions=False)
    assert len(out["refused"]) == 1


def test_a_later_series_with_its_own_prediction_supersedes_the_earlier_in_the_headline(tmp_path):
    """Re-measured with a new prediction recorded first (tagged, as the harness now writes):
    the new series is the headline row, the old one stays listed with what replaced it."""
    pred, meas = tp2_records()
    new_pred = {**copy.deepcopy(pred), "run_id": "rerun",
                "recorded_at": "2026-11-27T09:00:00+00:00",
                "predicted": {**pred["predicted"], "step_time_s": 0.191}}
    new_meas = [{**copy.deepcopy(m), "run_id": "rerun", "tag": "tp2-mb8-c",
                 "recorded_at": f"2026-11-27T09:0{i + 1}:00+00:00"} for i, m in enumerate(meas)]
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, new_pred, *new_meas])],
                          repredictions=False)
    old, new = out["rows"]
    assert old["superseded_by"]["first_measured_at"] == new["first_measured_at"]
    assert "superseded_by" not in new and out["superseded"] == 1 and out["configs"] == 1
    assert out["step_time_error"]["median"] == pytest.approx(abs(new["step_time_error"]))
    # compared with the old prediction (none fresh), a later series replaces nothing
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, *new_meas])],
                          repredictions=False)
    assert out["superseded"] == 0 and out["configs"] == 2


def test_same_tag_measured_again_after_a_changed_prediction_is_a_new_series(tmp_path):
    """Both series tagged alike (the harness tags every record): a changed prediction
    recorded between them starts a new series that supersedes the old one, and a copy of
    that prediction recorded earlier in the new session (a call that measured other
    configs) is no peek at the new series, so it is not refused."""
    pred, meas = tp2_records()
    old = [{**copy.deepcopy(m), "tag": "tp2-mb8-c"} for m in meas]
    new_pred = {**copy.deepcopy(pred), "run_id": "callB",
                "recorded_at": "2026-11-27T09:00:00+00:00",
                "predicted": {**pred["predicted"], "step_time_s": 0.191}}
    early = {**copy.deepcopy(new_pred), "run_id": "callA",
             "recorded_at": "2026-11-27T08:00:00+00:00"}
    new_meas = [{**copy.deepcopy(m), "run_id": "callB",
                 "recorded_at": f"2026-11-27T09:0{i + 1}:00+00:00"} for i, m in enumerate(old)]
    out = compare.compare([_write(tmp_path / "r.jsonl",
                                  [pred, *old, early, new_pred, *new_meas])],
                          repredictions=False)
    first, second = out["rows"]
    assert first["launches"] == 3 and second["launches"] == 3
    assert "superseded_by" in first and out["configs"] == 1 and out["refused"] == []
    assert second["predicted_step_time_s"] == 0.191
    # the same prediction recorded again (a rerun of the same planner) pools the launches
    same = {**copy.deepcopy(pred), "run_id": "callB", "recorded_at": new_pred["recorded_at"]}
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *old, same, *new_meas])],
                          repredictions=False)
    assert len(out["rows"]) == 1 and out["rows"][0]["launches"] == 6


def test_a_new_harness_revision_starts_a_series_that_supersedes_at_the_same_prediction(
        tmp_path):
    """The planner unchanged (its prediction recorded again, as a rerun's), the harness
    changed what it measures: the new revision's launches are a series of their own, which
    replaces the old one in the headline; at the same revision they pool."""
    pred, meas = tp2_records()
    old = [{**copy.deepcopy(m), "tag": "tp2-mb8-c"} for m in meas]
    same = {**copy.deepcopy(pred), "run_id": "callB", "recorded_at": "2026-11-27T09:00:00+00:00"}
    new_meas = [{**copy.deepcopy(m), "run_id": "callB", "harness_revision": 2,
                 "recorded_at": f"2026-11-27T09:0{i + 1}:00+00:00"} for i, m in enumerate(old)]
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *old, same, *new_meas])],
                          repredictions=False)
    first, second = out["rows"]
    assert first["launches"] == 3 and second["launches"] == 3
    assert "superseded_by" in first and out["configs"] == 1 and out["refused"] == []
    assert "superseded_by" not in second and out["superseded"] == 1
    for m in new_meas:  # the same revision as the old launches: one series
        m["harness_revision"] = 1
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *old, same, *new_meas])],
                          repredictions=False)
    assert len(out["rows"]) == 1 and out["rows"][0]["launches"] == 6


def _on_host(meas: list[dict], gpu_count: int, scale: float, day: str) -> list[dict]:
    """The launches run again on a host of `gpu_count` GPUs on `day`, each step `scale` times
    as long."""
    out = copy.deepcopy(meas)
    for m in out:
        m["provenance"]["gpu_count"] = gpu_count
        m["recorded_at"] = m["recorded_at"].replace("2026-11-26", day)
        m["step_times_s"] = [t * scale for t in m["step_times_s"]]
        m["step_time_s"] *= scale
        m["step_time_s_ci"] = [t * scale for t in m["step_time_s_ci"]]
        m["tokens_per_s_per_gpu"] /= scale
        m["tokens_per_s_per_gpu_ci"] = sorted(v / scale for v in m["tokens_per_s_per_gpu_ci"])
    return out


def test_headline_is_the_largest_host_not_all_hosts_pooled(tmp_path):
    """A config measured on a 4-GPU host close to its prediction and on a 2-GPU host far from
    it: the headline (and meets_targets) is the 4-GPU host's, the pooled figures are apart."""
    pred, meas = tp2_records()  # on the 2-GPU host: the step about 25% longer than predicted
    four = _on_host(meas, 4, 0.76, "2026-11-27")  # within about 1% of the prediction
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, *four])],
                          repredictions=False)
    small, large = (next(r for r in out["rows"] if r["host"] == h)
                    for h in ("4 x NVIDIA H200", "2 x NVIDIA H200"))
    assert abs(small["step_time_error"]) < 0.02 < 0.2 < abs(large["step_time_error"])
    assert out["headline_host"] == "4 x NVIDIA H200" and out["configs"] == 1
    assert out["step_time_error"]["max"] == pytest.approx(abs(small["step_time_error"]))
    assert out["signed_step_time_error_median"] == pytest.approx(small["step_time_error"])
    assert out["all_hosts"]["configs"] == 2
    assert out["all_hosts"]["step_time_error"]["max"] == pytest.approx(
        abs(large["step_time_error"]))
    assert out["meets_targets"]  # judged on the headline host: the 2-GPU miss is not in it
    assert out["end_to_end_fit"]["median"] is None  # fitted on the headline host's one config


def test_a_prediction_whose_own_run_never_measured_its_config_is_not_refused(tmp_path):
    """A later call records predictions for the whole suite and runs out of budget before
    this config: no measurement of its run to peek at, so it is neither refused nor compared."""
    pred, meas = tp2_records()
    unrun = {**copy.deepcopy(pred), "run_id": "callC", "recorded_at": "2026-11-26T03:00:00+00:00"}
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, unrun])],
                          repredictions=False)
    assert out["refused"] == [] and out["configs"] == 1
    assert out["rows"][0]["predicted_at"] == pred["recorded_at"]
    # the same prediction in the measured run, after its launches, is a peek: refused
    late = {**unrun, "run_id": meas[0]["run_id"]}
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, late])],
                          repredictions=False)
    assert [r["predicted_at"] for r in out["refused"]] == [late["recorded_at"]]
    # a run id that is not text (a prediction's is not checked) names no run: not refused
    odd = {**unrun, "run_id": [meas[0]["run_id"]]}
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, odd])],
                          repredictions=False)
    assert out["refused"] == [] and out["configs"] == 1


def test_layer_slices_are_the_width_check_and_in_no_proxy_figure(committed):
    current = [r for r in committed["rows"]
               if "superseded_by" not in r and r["predicted_step_time_s"] is not None]
    sliced = [r for r in current if SLICE.fullmatch(r["model"])]
    assert sliced and all(r["model"].endswith("-layers") for r in sliced)
    width = committed["width_check"]
    assert width["configs"] == len(sliced)
    assert width["step_time_error"]["max"] == max(abs(r["step_time_error"]) for r in sliced)
    assert committed["all_hosts"]["configs"] == len(current) - len(sliced)
    head = [r for r in current if r["host"] == committed["headline_host"]
            and r not in sliced]
    assert committed["configs"] == len(head)
    assert committed["step_time_error"]["max"] == max(abs(r["step_time_error"]) for r in head)
    assert width["repredicted"]["calibrated"]["step_time_error"]["n"] == len(sliced)


def test_memory_band_is_the_width_checks_largest_overrun(committed):
    band = compare_views.memory_band(committed)
    sliced = [r for r in committed["rows"] if "superseded_by" not in r
              and r["memory_error"] is not None and SLICE.fullmatch(r["model"])]
    assert band["n"] == len(sliced) > 0
    ratios = {r["config"]: r["measured_memory_gib"] / r["predicted_memory_gib"] for r in sliced}
    assert band["factor"] == pytest.approx(max(1.0, max(ratios.values())))
    assert ratios[band["config"]] == pytest.approx(max(ratios.values()))
    over_predicted = {**committed, "rows": [{**r, "memory_error": 0.2} for r in sliced]}
    assert compare_views.memory_band(over_predicted)["factor"] == 1.0  # never below 1
    none = compare_views.memory_band({**committed, "rows": []})
    assert none == {"factor": None, "config": None, "n": 0}


def test_per_layer_differences_slices_alike_but_for_depth(committed):
    pairs = committed["width_check"]["per_layer"]
    assert pairs and pairs == compare_views.per_layer(committed["rows"])
    rows = {r["config"]: r for r in committed["rows"] if "superseded_by" not in r}
    for p in pairs:
        deep, flat = rows[p["to"]], rows[p["from"]]
        assert deep["layout"] == flat["layout"] and deep["host"] == flat["host"] == p["host"]
        assert p["layers"] == 2  # the committed twins: 4 and 2 blocks
        assert p["measured_step_s"] == pytest.approx(
            (deep["measured_step_time_s"] - flat["measured_step_time_s"]) / 2)
        assert p["predicted_memory_gib"] == pytest.approx(
            (deep["predicted_memory_gib"] - flat["predicted_memory_gib"]) / 2)
        assert p["step_time_error"] == pytest.approx(
            p["predicted_step_s"] / p["measured_step_s"] - 1)
        low, high = p["measured_step_ci"]
        assert low <= p["measured_step_s"] <= high
    # 4-GPU slices have no 2-block twin: no pair across hosts, layouts or GPU counts
    assert not any("tp4" in p["to"] for p in pairs)


def test_per_layer_needs_two_depths_and_takes_neighbours(committed):
    rows = [r for r in committed["rows"] if "superseded_by" not in r]
    twin = next(r for r in rows if r["config"] == "s13b-1gpu-mb1-c")
    assert compare_views.per_layer([twin]) == []
    # a third depth pairs with its nearest: 8 with 4, 4 with 2, over their own layer gaps
    deeper = {**twin, "config": "eight", "model": "llama-13b:8-layers",
              "measured_step_time_s": twin["measured_step_time_s"] + 0.08,
              "measured_step_time_ci": [v + 0.08 for v in twin["measured_step_time_ci"]]}
    flat = next(r for r in rows if r["config"] == "s13b-1gpu-mb1-l2-c")
    got = compare_views.per_layer([flat, deeper, twin])
    assert [(p["to"], p["from"], p["layers"]) for p in got] == [
        ("eight", "s13b-1gpu-mb1-c", 4), ("s13b-1gpu-mb1-c", "s13b-1gpu-mb1-l2-c", 2)]
    assert got[0]["measured_step_s"] == pytest.approx(0.02)
    other = {**flat, "layout": {**flat["layout"], "micro_batch": 2}}  # not alike: no pair
    assert compare_views.per_layer([other, twin]) == []


def test_a_records_yaml_model_path_is_read_from_the_repository_root(tmp_path, monkeypatch):
    """Records name a model file as the run wrote it (from the repository root); the
    runbook re-predicts them from notebooks/, where that relative path does not exist."""
    from trainplan.compare.after import record_model
    from trainplan.errors import PresetNotFound

    monkeypatch.chdir(tmp_path)
    spec = record_model("data/models/llama3-8b.yaml:4-layers")
    assert spec.n_layers == 4 and spec.vocab > 100_000
    with pytest.raises(PresetNotFound):
        record_model("data/models/no-such-model.yaml")


def test_repredictions_keep_the_records_precision():
    """An fp8 record is re-predicted in fp8 and its recipe, as its prediction was: not as the
    bf16 config of the same layout (which would make fp8's re-prediction error the speed-up)."""
    def rows_of(run):
        out = compare.compare([str(run / "predictions.jsonl"), str(run / "measurements.jsonl")])
        return {r["config"]: r for r in out["rows"]}

    rows = rows_of(ROOT / "data/measurements/validate-h200x2-20261127b/f8")
    bf16, fp8, row = (rows[t]["repredicted"]["calibrated"]["step_time_s"] for t in (
        "s13b-z2-mb2-c-2gpu", "s13b-z2-mb2-c-fp8-2gpu", "s13b-z2-mb2-c-fp8-row-2gpu"))
    assert fp8 < row < bf16
    # the same planner and fp8 terms predicted these before the run, bar the host terms and
    # the rowwise cast scale (3.04 then, 2.95 committed: one shape then ran eagerly)
    rows = rows_of(ROOT / "data/measurements/validate-h200x2-20261127c/f8")
    for tag in ("s13b-z2-mb2-c-fp8-2gpu", "s13b-z2-mb2-c-fp8-row-2gpu"):
        r = rows[tag]
        assert r["repredicted"]["calibrated"]["step_time_s"] == pytest.approx(
            r["predicted_step_time_s"], rel=0.05)


def test_allocator_modes_never_share_a_series(tmp_path):
    """A run under expandable segments is not compared with a prediction made for the caching
    allocator, and is re-predicted in its own mode."""
    pred, meas = tp2_records()
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    exp = [copy.deepcopy(m) for m in meas]
    for m in exp:
        m["provenance"] = {**(m.get("provenance") or {}), "env": env}
    assert matching.allocator(pred) == matching.allocator(meas[0]) == "caching"
    assert matching.allocator(exp[0]) == "expandable"
    made_there = copy.deepcopy(pred)  # made in an expandable process by an older planner
    made_there["provenance"] = {**(pred.get("provenance") or {}), "env": env}
    assert matching.allocator(made_there) == "caching"
    out = compare.compare([_write(tmp_path / "a.jsonl", [pred, *exp])], repredictions=False)
    assert [r["predicted_step_time_s"] for r in out["rows"]] == [None]  # no match
    named = copy.deepcopy(pred)
    named["config"]["allocator"] = "expandable"  # what validate records now
    out = compare.compare([_write(tmp_path / "b.jsonl", [named, *exp])], repredictions=True)
    row = out["rows"][0]
    assert row["allocator"] == "expandable" and row["predicted_step_time_s"] is not None
    again = compare.compare([_write(tmp_path / "c.jsonl", [pred, *meas])], repredictions=True)
    old = again["rows"][0]
    assert old["allocator"] == "caching"
    # the same config re-predicted in the two modes: expandable holds less reserved
    mem = {r["allocator"]: r["repredicted"]["calibrated"]["memory_gib"] for r in (row, old)}
    assert mem["expandable"] < mem["caching"]


def test_a_later_expandable_series_supersedes_a_caching_series_of_its_config(tmp_path):
    """The harness runs under expandable segments since the planner priced the mode: a config
    measured again that way, with a fresh prediction for that mode, replaces its caching
    series in the headline (the two never pair with each other's prediction)."""
    pred, meas = tp2_records()
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    new_pred = copy.deepcopy(pred)
    new_pred.update(run_id="rerun", recorded_at="2026-11-27T09:00:00+00:00")
    new_pred["config"]["allocator"] = "expandable"
    new_pred["predicted"] = {**pred["predicted"], "step_time_s": 0.191}
    new_meas = []
    for i, m in enumerate(meas):
        m2 = copy.deepcopy(m)
        m2.update(run_id="rerun", recorded_at=f"2026-11-27T09:0{i + 1}:00+00:00")
        m2["provenance"] = {**(m2.get("provenance") or {}), "env": env}
        new_meas.append(m2)
    out = compare.compare([_write(tmp_path / "r.jsonl", [pred, *meas, new_pred, *new_meas])],
                          repredictions=False)
    old, new = sorted(out["rows"], key=lambda r: r["first_measured_at"])
    assert (old["allocator"], new["allocator"]) == ("caching", "expandable")
    assert old["superseded_by"]["first_measured_at"] == new["first_measured_at"]
    assert "superseded_by" not in new and out["configs"] == 1
    assert new["predicted_step_time_s"] == 0.191
