"""A suite file written by hand (`bench --suite`, `validate --suite`): every config is checked
when the file is read, before anything is predicted, written or launched; a bad one is one
SpecError line naming the file, the config and the value. Predictions are all priced before
the first is written, so a config the planner refuses leaves no predictions file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainplan import cli
from trainplan.bench.series import suite as suite_mod
from trainplan.errors import SpecError, TrainplanError

ROOT = Path(__file__).resolve().parents[2]
HEAD = "model: llama-1.3b\ncluster: dgx-h100\nseq_len: 2048\nconfigs:\n"
GOOD = "  - {tag: ok, gpus: 2, layout: {dp: 2, zero: 2, micro_batch: 4}}\n"
BAD = {
    "zero-9": ("  - {tag: a, gpus: 2, layout: {dp: 2, zero: 9}}\n", "zero = 9"),
    "micro-batch-list": ("  - {tag: a, gpus: 2, layout: {dp: 2, micro_batch: [1]}}\n",
                         "micro_batch = [1]"),
    "recompute": ("  - {tag: a, gpus: 2, layout: {dp: 2, recompute: most}}\n",
                  "recompute = 'most'"),
    "tag-path": ("  - {tag: ../../evil, gpus: 2, layout: {dp: 2}}\n", "'../../evil'"),
    "tag-empty": ("  - {tag: '', gpus: 2, layout: {dp: 2}}\n", "tag '' is not valid"),
    "tag-twice": (GOOD, "tag 'ok' is given twice"),
    "steps": ("  - {tag: a, gpus: 2, steps: -5}\n", "steps = -5"),
    "steps-huge": ("  - {tag: a, gpus: 2, steps: 99999999999999999999}\n",
                   "steps = 99999999999999999999"),
    "warmup": ("  - {tag: a, gpus: 2, warmup: x}\n", "warmup = 'x'"),
    "extra-args": ("  - {tag: a, gpus: 2, extra_args: 5}\n", "extra_args = 5"),
    "extra-args-nested": ("  - {tag: a, gpus: 2, extra_args: [[1]]}\n", "extra_args = [[1]]"),
    "compile": ("  - {tag: a, gpus: 2, compile: maybe}\n", "'maybe'"),
    "layers": ("  - {tag: a, gpus: 2, layers: 9999}\n", "9999"),
    "model": ("  - {tag: a, gpus: 2, model: no-such-model}\n", "'no-such-model'"),
}


def _suite(tmp_path, config: str):
    path = tmp_path / "s.yaml"
    path.write_text(HEAD + GOOD + config)
    return path


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_bad_config_is_one_line_naming_the_value(tmp_path, case):
    config, needle = BAD[case]
    path = _suite(tmp_path, config)
    with pytest.raises(SpecError) as err:
        suite_mod.load_suite(str(path))
    text = str(err.value)
    assert "\n" not in text and str(path) in text and needle in text, text


def test_good_configs_and_the_committed_suites_still_read(tmp_path):
    path = _suite(tmp_path, "  - {tag: b, gpus: 1, compile: true, naive: true, steps: 14,"
                            " warmup: 0, extra_args: [--num-workers, 2]}\n")
    assert [c["tag"] for c in suite_mod.load_suite(str(path))["configs"]] == ["ok", "b"]
    for committed in sorted((ROOT / "data" / "suites").glob("*.yaml")):
        if "configs:" in committed.read_text():
            assert suite_mod.load_suite(str(committed))["configs"]


def test_dry_run_refuses_it_with_exit_2_and_writes_nothing(tmp_path, capsys):
    path = _suite(tmp_path, BAD["tag-path"][0])
    argv = ["bench", "--suite", str(path), "--out", str(tmp_path / "out"), "--dry-run"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "'../../evil'" in err and not (tmp_path / "out").exists()


def test_a_config_the_planner_refuses_leaves_no_predictions(tmp_path):
    path = _suite(tmp_path, "  - {tag: b, gpus: 2, layout: {dp: 3}}\n")
    s = suite_mod.load_suite(str(path))
    with pytest.raises(TrainplanError, match="--dp 3"):
        suite_mod.predict_all([(s, c) for c in s["configs"]], tmp_path, "NVIDIA H100 80GB HBM3",
                              "r1")
    assert not (tmp_path / "predictions.jsonl").exists()
