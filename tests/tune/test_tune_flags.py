"""`trainplan tune` and `suggest --study`: a flag the run would not use is refused, one line.

Each refusal comes before any storage, record or lock file is made (the table's runs
would otherwise start a study: `--stop-after-s 0.001` keeps such a run short), and the
flags that are used still reach the study (`run_stages` stubbed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainplan import cli
from trainplan.commands.tuning import study_name
from trainplan.tune import loop
from trainplan.tune import study as tune

from .test_tune import fake_study

ROOT = Path(__file__).resolve().parents[2]
SUITE = str(ROOT / "data" / "suites" / "tune-2gpu.yaml")
COMMON = ["--cpu", "--storage", "{dir}/s.journal", "--gpu-hours", "1", "--stop-after-s", "0.001",
          "--no-progress"]
RUN = ["--model", "llama-1.3b", *COMMON]

BAD = {
    # --report reads a stored study: every flag of a run is refused, the first one named
    "report-run-flags": (["--report", "--model", "no-such-model", "--gpu-hours", "5",
                          "--workers", "4", "--cpu"], "--model 'no-such-model' is for running"),
    "report-cpu": (["--report", "--storage", "{dir}/s.journal", "--cpu"], "--cpu is for"),
    "report-workers": (["--report", "--workers", "4"], "--workers 4 is for running"),
    "report-share-0": (["--report", "--effects-share", "0"], "--effects-share 0 is for"),
    "report-suite": (["--report", "--suite", SUITE], "--suite"),
    "report-no-progress": (["--report", "--no-progress"], "--no-progress is for"),
    "report-study-name-alone": (["--report", "--study-name", "bogus"],
                                "--study-name 'bogus' needs --storage"),
    # --effects-share 0 (the default): no effects stage, so its flags are not used
    "share-0-base": ([*RUN, "--base", "999", "--effects-pairing", "launches"],
                     "--base '999' is not used: --effects-share 0"),
    "share-0-pairing": ([*RUN, "--effects-pairing", "launches"], "--effects-pairing 'launches'"),
    "share-0-halfwidth": ([*RUN, "--effects-share", "0", "--effects-halfwidth", "5"],
                          "--effects-halfwidth 5 is not used"),
    "share-0-knobs": ([*RUN, "--effects-knobs", "pack"], "--effects-knobs 'pack'"),
    "share-0-max-pairs": ([*RUN, "--effects-max-pairs", "4"], "--effects-max-pairs 4"),
    # --effects-share 1: no search, so its flags are not used
    "share-1-workers": ([*RUN, "--effects-share", "1", "--base", "plan", "--workers", "4"],
                        "--workers 4 is not used: --effects-share 1 runs no search"),
    "share-1-trials": ([*RUN, "--effects-share", "1", "--trials", "3"], "--trials 3"),
    "share-1-search-batch": ([*RUN, "--effects-share", "1", "--search-batch", "2"],
                             "--search-batch 2"),
    # the suite names its own GPUs; CPU launches write no records
    "suite-gpus": (["--suite", SUITE, "--gpus", "7", *COMMON], "--gpus 7 is not used with "
                   "--suite"),
    "cpu-records": ([*RUN, "--records", "{dir}/r.jsonl"], "--records"),
    # a base the effects stage cannot have: refused before the storage is made
    "share-1-base-trial": ([*RUN, "--effects-share", "1", "--base", "999"],
                           "--base 999: trial 999 has no measurement"),
    "share-1-base-best": ([*RUN, "--effects-share", "1"], "--base best: the search has "
                          "measured no configuration"),
    # a --storage naming no file: it was a ValueError traceback ("PosixPath('.') has an
    # empty name"), exit 1
    "storage-empty": ([*RUN, "--storage", ""], "--storage '' names no file; use a study file"),
    "storage-journal-empty": ([*RUN, "--storage", "journal:"], "--storage 'journal:' names no"),
    "storage-sqlite-empty": ([*RUN, "--storage", "sqlite:///"], "--storage 'sqlite:///' names"),
    "storage-dot-dot": ([*RUN, "--storage", "journal:{dir}/.."], "/..' names no file"),
    "report-storage-empty": (["--report", "--storage", ""], "--storage '' names no file"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    argv, word = BAD[case]
    assert cli.main(["tune", *[a.format(dir=tmp_path) for a in argv]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error:"), err
    assert word in err, err
    assert list(tmp_path.iterdir()) == []  # no storage, records or lock


@pytest.fixture
def stages(monkeypatch):
    """`run_stages` stubbed: what the command passes it."""
    seen = {}

    def run(suite, **kw):
        seen.update(suite=suite, **kw)
        return {"study": kw["name"], "storage": kw["storage"], "search": "stubbed"}

    monkeypatch.setattr(loop, "run_stages", run)
    return seen


def _run(tmp_path, *argv) -> None:
    assert cli.main(["tune", *[a.format(dir=tmp_path) for a in argv], "--json"]) == 0


def test_left_out_flags_get_their_defaults(stages, tmp_path, capsys):
    _run(tmp_path, *RUN)
    assert stages["name"] == "llama-1.3b"  # not "llama-1": a preset name is not a path
    assert stages["suite"]["gpus"] == 1 and stages["trials"] == 30
    assert (stages["workers"], stages["batch"], stages["effects_share"]) == (1, 1, 0.0)
    assert stages["effects"] == {}  # `run_effects`'s own defaults apply
    assert stages["records_path"] is None and stages["progress"] is False


def test_a_share_between_0_and_1_takes_both_stages_flags(stages, tmp_path, capsys):
    _run(tmp_path, *RUN, "--effects-share", "0.5", "--workers", "2", "--trials", "7",
         "--base", "3", "--effects-halfwidth", "5", "--effects-knobs", "pack,micro_batch",
         "--effects-max-pairs", "4", "--effects-pairing", "launches", "--gpus", "2")
    assert (stages["workers"], stages["trials"], stages["effects_share"]) == (2, 7, 0.5)
    assert stages["effects"] == {"base": "3", "halfwidth": 5.0, "max_pairs": 4,
                                 "knob_names": ["pack", "micro_batch"], "pairing": "launches"}
    assert stages["suite"]["gpus"] == 2


def test_share_1_takes_the_effects_flags_and_share_0_the_searchs(stages, tmp_path, capsys):
    _run(tmp_path, *RUN, "--effects-share", "1", "--base", "plan", "--effects-pairing",
         "sweep-nccl")
    assert stages["effects"] == {"base": "plan", "pairing": "sweep-nccl"}
    _run(tmp_path, *RUN, "--search-batch", "4", "--trials", "9")
    assert (stages["batch"], stages["trials"], stages["effects"]) == (4, 9, {})


def test_a_suite_keeps_its_gpus_and_names_the_study(stages, tmp_path, capsys):
    _run(tmp_path, "--suite", SUITE, *COMMON)
    assert stages["suite"]["gpus"] == 2 and stages["name"] == "tune-2gpu"
    _run(tmp_path, *RUN, "--study-name", "mine")
    assert stages["name"] == "mine"


@pytest.mark.parametrize("suite,model,name", [
    (None, "llama-1.3b", "llama-1.3b"),
    (None, "llama-13b:4-layers", "llama-13b:4-layers"),
    (None, "models/tiny.yaml", "tiny"),
    (None, "models/tiny.v2.YML", "tiny.v2"),
    ("data/suites/tune-2gpu.yaml", None, "tune-2gpu"),
    ("suites/s.1.yaml", None, "s.1"),
])
def test_the_default_study_name_is_the_name_as_given(suite, model, name):
    assert study_name(suite, model) == name


def test_a_real_run_names_the_study_after_the_preset(tmp_path, capsys):
    _run(tmp_path, *RUN)  # --stop-after-s 0.001: stops before its first launch
    out = json.loads(capsys.readouterr().out)
    assert out["study"] == "llama-1.3b" and out["stopped"] == "time"
    store, _ = tune.open_storage(str(tmp_path / "s.journal"), must_exist=True)
    assert [s.study_name for s in store.get_all_studies()] == ["llama-1.3b"]


def test_report_still_takes_storage_and_study_name(tmp_path, capsys):
    fake_study(tmp_path / "fake.journal")
    assert cli.main(["tune", "--report", "--storage", str(tmp_path / "fake.journal"),
                     "--study-name", "fake", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["study"] == "fake"


def _two_studies(path: Path) -> None:
    import optuna

    store, _ = tune.open_storage(str(path), must_exist=False)
    for name in ("a", "b"):
        optuna.create_study(storage=store, study_name=name)


@pytest.mark.parametrize("case", ["missing", "not-json", "two-studies", "folder"])
def test_suggest_names_study_and_its_value(case, tmp_path, capsys):
    path = tmp_path / "s.journal"
    if case == "not-json":
        path.write_text("x: 1\n")
    elif case == "two-studies":
        _two_studies(path)
    value = "nosuch" if case == "missing" else str(tmp_path if case == "folder" else path)
    rc = cli.main(["suggest", "--model-size", "7B", "--gpus", "8", "--dataset-tokens", "1B",
                   "--study", value])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"trainplan: error: --study {value}"), err
    assert "--storage" not in err and "--study-name" not in err, err


def test_suggest_study_that_is_a_folder_says_so(tmp_path, capsys):
    """It said "no file" of a folder that is there."""
    rc = cli.main(["suggest", "--model-size", "7B", "--gpus", "8", "--dataset-tokens", "1B",
                   "--study", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"--study {tmp_path} is a folder; name the study file in it" in err
    assert "journal:PATH" in err and "sqlite:///PATH" in err
