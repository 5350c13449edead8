"""The 4-GPU re-check of the knob study's top knobs: launches assigned to configs, effects."""

from __future__ import annotations

import json
import shutil

import pytest

from trainplan.errors import RecordError
from trainplan.tune import recheck as knob_recheck


def test_committed_recheck_assigns_launches_by_layout_and_order():
    out = knob_recheck.recheck()
    rows = {r["tag"]: r for r in out["rows"]}
    assert out["gpus"] == 4 and out["base"] == "knob-best-4gpu"
    assert rows["knob-mb4-4gpu"]["change"] == "micro_batch 16 -> 4"
    assert rows["knob-mb4-4gpu"]["measurable"] and rows["knob-mb4-4gpu"]["effect_pct"] < -5
    assert rows["knob-nw0-4gpu"]["change"].startswith("num_workers 1 -> 0")
    assert rows["knob-pf8-4gpu"]["launches"] == 0 and "effect_pct" not in rows["knob-pf8-4gpu"]
    assert all(r["launches"] == 2 for t, r in rows.items() if t != "knob-pf8-4gpu")


def _copy(tmp_path):
    dst = tmp_path / "knobs"
    shutil.copytree(knob_recheck.COMMITTED, dst)
    return dst


def test_records_that_name_their_tag_need_no_order(tmp_path):
    folder = _copy(tmp_path)
    lines = (folder / "measurements.jsonl").read_text().splitlines()
    tags = ["knob-best-4gpu"] * 2 + ["knob-mb4-4gpu"] * 2 + ["knob-nw0-4gpu"] * 2
    tagged = [json.dumps({**json.loads(ln), "tag": t}) for ln, t in zip(lines, tags, strict=True)]
    (folder / "measurements.jsonl").write_text("\n".join(reversed(tagged)) + "\n")
    (folder / "validate.json").unlink()
    rows = {r["tag"]: r for r in knob_recheck.recheck(folder)["rows"]}
    assert rows["knob-mb4-4gpu"]["change"] == "micro_batch 16 -> 4"
    assert rows["knob-mb4-4gpu"]["launches"] == 2 and rows["knob-mb4-4gpu"]["measurable"]


def test_an_order_that_contradicts_the_layouts_is_refused(tmp_path):
    folder = _copy(tmp_path)
    call = json.loads((folder / "validate.json").read_text())
    tags = [c["tag"] for c in call["configs"]]
    i, j = tags.index("knob-best-4gpu"), tags.index("knob-mb4-4gpu")
    call["configs"][i], call["configs"][j] = call["configs"][j], call["configs"][i]
    (folder / "validate.json").write_text(json.dumps(call))
    with pytest.raises(RecordError, match="cannot be config"):
        knob_recheck.recheck(folder)


def test_no_folder_is_none(tmp_path):
    assert knob_recheck.recheck(tmp_path / "absent") is None


def test_change_names_every_knob_that_differs():
    assert knob_recheck.change({"a": 1, "b": 2}, {"a": 1, "b": 3}) == "b 2 -> 3"
    assert knob_recheck.change({"a": 1}, {"a": 1}).startswith("none")


def test_sentence_states_each_change_and_its_verdict():
    words = knob_recheck.sentence(knob_recheck.recheck())
    assert words.startswith("On 4 x NVIDIA H200")
    assert "`micro_batch 16 -> 4` changed tokens/s/GPU by -1" in words
    assert "a measurable effect" in words and "no measurable effect" in words
    assert "`prefetch_factor 2 -> 8` was not run" in words


def test_table_has_one_row_a_config_and_readable_figures():
    t = knob_recheck.table(knob_recheck.recheck())
    assert list(t.index) == ["knob-best-4gpu", "knob-mb4-4gpu", "knob-nw0-4gpu", "knob-pf8-4gpu"]
    assert t.loc["knob-mb4-4gpu", "measurable"] == "yes"
    assert t.loc["knob-pf8-4gpu", "95% interval"] == "not run"
    assert t.loc["knob-mb4-4gpu", "vs start"].startswith("-1")
