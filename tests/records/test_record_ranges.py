"""Physical ranges of the figures compare reads: a record out of them is refused with one line
naming the field, the value and the valid range, and never written."""

from __future__ import annotations

import copy
import json

import pytest
from tests.records.test_records import LAYOUT, measurement

from trainplan.errors import RecordError
from trainplan.records import schema as records


def prediction(**predicted):
    return records.prediction_record(
        model="llama-1.3b", layout=LAYOUT, gpus=2, card="h200-sxm",
        predicted={"step_time_s": 0.5, "memory_gib": {"total": 38.0},
                   "time_breakdown_s": {"compute": 0.4, "bubble": 0.0}, **predicted})


@pytest.mark.parametrize("field, value, said", [
    ("tokens_per_s_per_gpu", 0.0, "1e-06 to 1e+09 tokens/s"),
    ("step_time_s", 0.0, "1e-09 to 1e+06 s"),
    ("step_time_s", 1e300, "1e-09 to 1e+06 s"),
    ("peak_mem_reserved_gib", 1e300, "1e-06 to 1e+06 GiB"),
    ("peak_mem_reserved_gib", -469.5, "1e-06 to 1e+06 GiB"),
    ("peak_mem_allocated_gib", 0.0, "1e-06 to 1e+06 GiB"),
    ("tokens_per_step", 0, "1 to 1e+12 tokens"),
    ("mfu", -0.1, "0 to 10"),
    ("gpus", 0, "1 to 1e+12 GPUs"),
    ("harness_revision", 0, "1 to 1e+12"),
])
def test_a_figure_out_of_range_is_refused_and_not_written(tmp_path, field, value, said):
    path = tmp_path / "r.jsonl"
    records.append(path, measurement())
    before = path.read_bytes()
    bad = copy.deepcopy(measurement())
    bad[field] = value
    if field == "tokens_per_s_per_gpu":
        bad["tokens_per_s_per_gpu_ci"] = [value, value]
    with pytest.raises(RecordError) as err:
        records.append(path, bad)
    text = str(err.value)
    assert f"field '{field}' = {value!r} is out of range" in text and said in text
    assert str(path) in text and "\n" not in text and path.read_bytes() == before


def test_a_harness_revision_that_is_no_count_is_refused():
    bad = {**measurement(), "harness_revision": "2"}
    with pytest.raises(RecordError, match="harness_revision"):
        records.validate(bad)
    assert records.validate({**measurement(), "harness_revision": 2})["harness_revision"] == 2


@pytest.mark.parametrize("where, value, said", [
    ("step_times_s", [], "'step_times_s' is empty"),
    ("step_times_s", [0.5, 0.0], "'step_times_s[1]' = 0.0 is out of range"),
    ("tokens_per_s_per_gpu_ci", [-1.0, 1e12], "'tokens_per_s_per_gpu_ci[0]' = -1.0"),
    ("layout.tp", 0, "'layout.tp' = 0 is out of range; valid: 1 to 1e+12"),
    ("layout.zero", 4, "'layout.zero' = 4 is out of range; valid: 0 to 3"),
])
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, where, value, said):
    bad = copy.deepcopy(measurement())
    *parent, last = where.split(".")
    (bad[parent[0]] if parent else bad)[last] = value
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(measurement()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError) as err:
        records.load(path)
    assert str(err.value).startswith(f"{path}:2: ") and said in str(err.value)


@pytest.mark.parametrize("predicted, said", [
    ({"step_time_s": 0.0}, "'predicted.step_time_s' = 0.0 is out of range; valid: 1e-09"),
    ({"step_time_s": "fast"}, "'predicted.step_time_s' = 'fast' is str"),
    ({"memory_gib": {"total": 0.0}}, "'predicted.memory_gib.total' = 0.0 is out of range"),
    ({"memory_gib": {"total": -3.0}}, "'predicted.memory_gib.total' = -3.0"),
    ({"memory_gib": [38.0]}, "'predicted.memory_gib' = [38.0] is list"),
    ({"time_breakdown_s": {"compute": None}}, "'predicted.time_breakdown_s.compute' = None"),
    ({"time_breakdown_s": {"bubble": -0.1}}, "'predicted.time_breakdown_s.bubble' = -0.1"),
])
def test_a_prediction_s_figures_are_checked(predicted, said):
    with pytest.raises(RecordError) as err:
        prediction(**predicted)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_prediction_may_leave_figures_out():
    r = records.prediction_record(model="m", layout=LAYOUT, gpus=2, card="c",
                                  predicted={"mfu": 0.5, "memory_gib": None})
    assert r["predicted"]["memory_gib"] is None
    assert prediction(step_time_s=None)["predicted"]["step_time_s"] is None


def test_combine_launches_names_the_launch_that_differs():
    a, b = measurement(), measurement(tokens_per_step=4 * 8 * 2048)
    with pytest.raises(RecordError) as err:
        records.combine_launches([a, b])
    assert str(err.value).startswith("launch 2 of 2: ") and "'tokens_per_step'" in str(err.value)
    a["_where"], b["_where"] = "m.jsonl:1", "m.jsonl:7"
    with pytest.raises(RecordError) as err:
        records.combine_launches([a, b])
    text = str(err.value)
    assert text.startswith("m.jsonl:7: ") and "65536 here, 32768 at m.jsonl:1" in text
    b = copy.deepcopy(a) | {"_where": "m.jsonl:9", "step_time_s": 0.0}
    with pytest.raises(RecordError, match=r"^m\.jsonl:9: field 'step_time_s' = 0\.0"):
        records.combine_launches([a, b])
