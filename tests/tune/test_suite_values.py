"""A tune suite or study journal edited by hand: every suite field is checked for its type
and range when the suite is read (before any launch spends GPU time), and a journal whose
objective is not a plausible tokens/s/GPU is refused rather than reported; each is one
line naming the field and the value."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from trainplan import cli
from trainplan.errors import SpecError
from trainplan.tune import report
from trainplan.tune import study as tune
from trainplan.tune.study import StudyError

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "data" / "suites" / "tune-2gpu.yaml"
JOURNAL = ROOT / "data" / "measurements" / "tune-proxy-h200x4-20261128" / "study.journal"

BAD = [("gpus", "2", "gpus = '2'"), ("gpus", 0, "gpus = 0"), ("seq_len", -1, "seq_len = -1"),
       ("seq_len", 10**12, "seq_len = 1000000000000"), ("warmup", -1, "warmup = -1"),
       ("windows", "x", "windows = 'x'"), ("target_sequences", -5, "target_sequences = -5"),
       ("max_measure_s", math.nan, "max_measure_s = nan"),
       ("max_measure_s", 1e308, "max_measure_s = 1e+308"), ("max_launches", 0, "max_launches = 0"),
       ("reduction_factor", 1, "reduction_factor = 1"), ("n_startup", -1, "n_startup = -1"),
       ("seed", "x", "seed = 'x'"), ("launch_timeout_s", -1, "launch_timeout_s = -1"),
       ("extra_args", 5, "extra_args = 5"), ("extra_args", [[1]], "extra_args = [[1]]"),
       ("space", [1], "space = [1]"), ("model", ["x"], "model = ['x']"),
       ("cluster", None, "cluster = None"), ("layout", {"dp": 2.0}, "layout = {'dp': 2.0}"),
       ("max_launch", 3, "unknown field 'max_launch'")]


def _write(tmp_path, field, value) -> Path:
    suite = yaml.safe_load(SUITE.read_text())
    suite[field] = value
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.mark.parametrize("field, value, needle", BAD, ids=[b[2] for b in BAD])
def test_a_bad_suite_field_is_one_line_naming_it(tmp_path, field, value, needle):
    path = _write(tmp_path, field, value)
    with pytest.raises(SpecError) as err:
        tune.make_suite(suite_path=str(path))
    text = str(err.value)
    assert "\n" not in text and str(path) in text and needle in text, text


def test_the_committed_suites_still_read():
    for path in sorted((ROOT / "data" / "suites").glob("tune-*.yaml")):
        assert tune.make_suite(suite_path=str(path))["gpus"] >= 1


def test_the_tune_verb_refuses_before_any_storage_is_made(tmp_path, capsys):
    path = _write(tmp_path, "reduction_factor", 0)
    storage = tmp_path / "s.journal"
    argv = ["tune", "--suite", str(path), "--storage", str(storage), "--gpu-hours", "1", "--cpu"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "reduction_factor = 0" in err and not storage.exists(), err


@pytest.mark.parametrize("value", [1e300, -5.0])
def test_a_journal_with_an_implausible_objective_is_refused(tmp_path, value):
    lines = [json.loads(line) for line in JOURNAL.read_text().splitlines() if line.strip()]
    done = next(op for op in lines if op["op_code"] == 6 and op.get("values"))
    done["values"] = [value]
    path = tmp_path / "study.journal"
    path.write_text("".join(json.dumps(op) + "\n" for op in lines))
    with pytest.raises(StudyError) as err:
        report.report(str(path), flag="--study")
    text = str(err.value)
    assert "\n" not in text and "--study" in text and f"{value:.3g}" in text, text
