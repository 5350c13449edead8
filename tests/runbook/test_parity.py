"""Page 3's fp8 loss parity (`runbook.parity`): both kinds of run read, the newest first, each
seed judged against the tolerance, bad summaries refused in one line, the committed runs
plotted. Runs in temporary folders are built from the committed files, numbers replaced."""

from __future__ import annotations

import json
import shutil

import matplotlib.pyplot as plt
import pytest

from trainplan.errors import SpecError
from trainplan.runbook import figures, parity

HARNESS = sorted(parity.PARITY_DIR.glob("*.jsonl"))[0]
TRAINER = next(p for p in sorted(parity.PARITY_DIR.iterdir()) if p.is_dir())


def _harness(name: str, losses: list[float]) -> dict:
    rec = next(r for r in map(json.loads, HARNESS.read_text().splitlines())
               if r["layout"]["precision"] == name)
    return {**rec, "losses": losses}


def _summary(precision: str, seed: int, last_eval: float) -> dict:
    s = json.loads((TRAINER / f"{precision}-s0.json").read_text())
    evals = [{"step": 10, "eval_loss": 9.0}, {"step": 20, "eval_loss": last_eval}]
    return {**s, "seed": seed, "evals": evals}


def _write_trainer(folder, runs: dict) -> None:
    folder.mkdir()
    for (precision, seed), last in runs.items():
        (folder / f"{precision}-s{seed}.json").write_text(
            json.dumps(_summary(precision, seed, last)))
    (folder / "README.md").write_text("not a run")


def test_harness_runs_newest_first_one_precision_passed_over(tmp_path):
    steps = parity.TAIL + 20
    old = [_harness("bf16", [5.0] * steps), _harness("fp8", [6.0] * steps)]
    new = [_harness("bf16", [9.0] * 20 + [4.0] * parity.TAIL),
           _harness("fp8", [9.0] * 20 + [4.2] * parity.TAIL)]
    (tmp_path / "a-old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (tmp_path / "b-new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in new))
    (tmp_path / "c-bf16-only.jsonl").write_text(json.dumps(new[0]) + "\n")
    found = parity.runs(tmp_path)
    assert [r["name"] for r in found] == ["b-new.jsonl", "a-old.jsonl"]
    seed = found[0]["seeds"][0]
    assert (seed["bf16"], seed["fp8"]) == (pytest.approx(4.0), pytest.approx(4.2))
    assert not parity.met(found[0])
    note = parity.note(found)
    assert "4.200 against 4.000 in bf16 (+5.0%), outside the 3%" in note
    speed = new[1]["tokens_per_s_per_gpu"] / new[0]["tokens_per_s_per_gpu"]
    assert f"{speed:.2f} times" in note
    assert note.endswith("+20.0% (outside).")
    assert parity.verdict(-0.025) == "within"  # fp8 lower counts as a difference too
    assert parity.runs(tmp_path / "none") == [] and "not measured" in parity.note([])


def test_trainer_runs_are_judged_seed_by_seed(tmp_path):
    """Every seed with both precisions is compared on its last held-out loss; a seed with one
    precision is left out; one seed outside the tolerance and the run is not met."""
    _write_trainer(tmp_path / "h-20990101", {("bf16", 0): 4.0, ("fp8", 0): 4.04,
                                             ("bf16", 1): 4.4, ("fp8", 1): 4.3,
                                             ("bf16", 2): 4.0})
    run = parity.runs(tmp_path)[0]
    assert run["kind"] == "trainer" and [s["seed"] for s in run["seeds"]] == [0, 1]
    assert [s["change"] for s in run["seeds"]] == [pytest.approx(0.01), pytest.approx(-1 / 44)]
    assert parity.met(run)
    note = parity.note([run])
    assert "with 2 seeds" in note and "+1.0%, -2.3% (seed by seed): every seed within" in note
    assert "moves bf16's by up to 10.0%" in note  # 4.4 against 4.0
    _write_trainer(tmp_path / "h-20990102", {("bf16", 0): 4.0, ("fp8", 0): 4.2})
    newest = parity.runs(tmp_path)[0]
    assert newest["name"] == "h-20990102" and not parity.met(newest)
    assert "h-20990101" in parity.note(parity.runs(tmp_path))


@pytest.mark.parametrize("damage, words", [
    (lambda s: "{not json", "not valid JSON"),
    (lambda s: json.dumps({**s, "evals": []}), "not a trainer summary"),
    (lambda s: json.dumps({k: v for k, v in s.items() if k != "seed"}), "needs precision, seed"),
    (lambda s: json.dumps({**s, "precision": "fp8"}), "is not the file name's"),
    (lambda s: json.dumps({**s, "seed": "0"}), "seed '0' is not a whole number"),
    (lambda s: json.dumps({**s, "evals": [{"step": 40}]}), "must be numbers"),
    (lambda s: json.dumps({**s, "losses": "low"}), "must be numbers"),
    (lambda s: json.dumps({**s, "tokens_per_s_per_gpu": 0}), "the rate above 0"),
])
def test_a_bad_summary_is_refused_in_one_line(tmp_path, damage, words):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(TRAINER / "fp8-s0.json", folder)
    (folder / "bf16-s0.json").write_text(damage(json.loads((TRAINER / "bf16-s0.json")
                                                           .read_text())))
    with pytest.raises(SpecError, match=words) as err:
        parity.runs(tmp_path)
    assert "bf16-s0.json" in str(err.value) and "\n" not in str(err.value)


def test_two_summaries_of_one_seed_and_precision_are_refused(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("bf16-s0.json", "fp8-s0.json"):
        shutil.copy(TRAINER / name, folder)
    shutil.copy(TRAINER / "bf16-s0.json", folder / "bf16-s0-again.json")
    with pytest.raises(SpecError, match="a second bf16 summary of seed 0"):
        parity.runs(tmp_path)


def test_the_committed_runs_are_plotted():
    found = parity.runs()
    run = next(r for r in found if r["kind"] == "trainer")
    assert run["card"] == "NVIDIA H200"
    assert len(run["seeds"]) >= 3 and "harness" in {r["kind"] for r in found}
    fig = figures.loss_parity(run, parity.TOLERANCE)
    assert len(fig.axes[0].lines) == 2 * len(run["seeds"])  # each seed in each precision
    assert len(fig.axes[1].get_yticklabels()) == len(run["seeds"])
    plt.close(fig)
    harness = next(r for r in found if r["kind"] == "harness")
    fig = figures.loss_parity(harness, parity.TOLERANCE)  # one seed: steps and their mean
    assert len(fig.axes[0].lines) == 4
    plt.close(fig)
