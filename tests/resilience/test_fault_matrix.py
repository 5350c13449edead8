"""The fault matrix: JUnit XML to the page-5 table, every fault test described in words."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainplan.resilience import fault_matrix as fm

REPO = Path(__file__).resolve().parents[2]
XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.faults.test_storage"
  name="test_corruption_is_detected_reported_in_one_line_and_the_previous_is_chosen[flipped byte]"
  time="1.25"/>
<testcase classname="faults.test_restarts"
  name="test_hung_rank_fails_the_step_within_the_collective_timeout_then_restarts" time="20.5">
  <failure message="boom">trace</failure></testcase>
<testcase classname="tests.faults.test_units" name="test_rng_state_round_trips_through_json"
  time="0.01"><skipped message="no"/></testcase>
<testcase classname="tests.faults.test_new" name="test_something_new" time="0.2">
  <error message="x"/></testcase>
</testsuite></testsuites>"""


def test_junit_rows_carry_scenario_guarantee_node_id_outcome_and_duration():
    rows = fm.parse_junit(XML)
    assert [r["outcome"] for r in rows] == ["passed", "failed", "skipped", "error"]
    first = rows[0]
    assert first["scenario"] == "newest checkpoint damaged: flipped byte"
    assert "previous checkpoint is chosen" in first["guarantee"] and first["duration_s"] == 1.25
    assert first["test"] == ("tests/faults/test_storage.py::test_corruption_is_detected_"
                             "reported_in_one_line_and_the_previous_is_chosen[flipped byte]")
    assert rows[1]["test"].startswith("tests/faults/test_restarts.py::test_hung_rank")
    assert rows[3] == {**rows[3], "scenario": "something new", "guarantee": "",
                       "described": False}


def _fault_tests() -> set[str]:
    names = set()
    for path in (REPO / "tests" / "faults").glob("test_*.py"):
        names |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M))
    return names


def test_every_fault_test_has_its_scenario_and_guarantee_in_words():
    missing = _fault_tests() - set(fm.SCENARIOS)
    assert not missing, ("add these to trainplan.resilience.fault_matrix.SCENARIOS: "
                         f"{sorted(missing)}")
    stale = set(fm.SCENARIOS) - _fault_tests()
    assert not stale, f"SCENARIOS names tests that no longer exist: {sorted(stale)}"


def test_the_committed_matrix_covers_every_fault_test_and_all_passed():
    matrix = fm.latest(REPO / "data" / "measurements")  # the newest, which page 5 shows
    ran = {r["test"].split("::")[1].split("[")[0] for r in matrix["rows"]}
    assert ran == _fault_tests(), "regenerate: python -m trainplan.resilience.fault_matrix"
    assert all(r["outcome"] == "passed" and r["described"] for r in matrix["rows"])
    assert matrix["counts"]["passed"] == len(matrix["rows"]) and matrix["date"]


def test_main_from_junit_writes_the_table_and_exits_1_on_a_failure(tmp_path, capsys):
    xml = tmp_path / "f.xml"
    xml.write_text(XML)
    out = tmp_path / "m.json"
    assert fm.main(["--out", str(out), "--from-junit", str(xml)]) == 1
    matrix = json.loads(out.read_text())
    assert matrix["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    assert all(r["date"] == matrix["date"] and "commit" in r for r in matrix["rows"])
    assert "no scenario words for tests/faults/test_new.py" in capsys.readouterr().err
    ok = re.sub(r"<failure.*?</failure>|<skipped[^>]*/>|<error[^>]*/>", "", XML, flags=re.S)
    xml.write_text(ok)
    assert fm.main(["--out", str(out), "--from-junit", str(xml)]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--workers", "0"], "--workers = 0 must be >= 1"),
    (["--from-junit", "/no/such.xml"], "--from-junit /no/such.xml: no such file"),
])
def test_bad_flags_are_refused_in_one_line_with_exit_2(argv, words, capsys):
    assert fm.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {words}"
