"""`trainplan checkpoint`: the README contract, the 30-minute requirement, clean refusals."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import trainplan_cli
from trainplan.cli import main
from trainplan.commands.resilience import KEYS

DONE_WHEN = ["checkpoint", "--model", "llama-13b", "--gpus", "32", "--node-mtbf-hours", "2000",
             "--write-gbps-per-node", "2", "--restart-minutes", "10", "--max-lost-minutes", "30"]
MORE_KEYS = {"per_node_gb", "persist_s", "young_min", "daly_min", "keep", "retention_gb",
             "peak_storage_gb", "job_mtbf_hours", "limited_by", "mode"}


def _refused(r, cwd, fragment):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("trainplan: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert fragment in r.stderr, r.stderr
    assert list(cwd.iterdir()) == []


def test_done_when_command(tmp_path):
    """Issue 5: a real process, as a user runs it."""
    r = trainplan_cli([*DONE_WHEN, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(KEYS) | MORE_KEYS <= set(out)
    assert out["meets_requirement"] is True and out["worst_lost_min"] < 30.0
    assert 0 < out["interval_min"] and 0 < out["ettr"] < 1
    assert out["expected_lost_min"] <= out["worst_lost_min"]
    assert out["checkpoint_gb"] == pytest.approx(156.19, abs=0.01)


def test_done_when_impossible_requirement_is_refused(tmp_path):
    r = trainplan_cli([*DONE_WHEN[:-1], "10", "--json"], tmp_path)
    _refused(r, tmp_path, "--max-lost-minutes 10 cannot be met")


@pytest.mark.parametrize("flags", [[], ["--sync"], ["--async", "--keep", "3"],
                                   ["--bf16-weights", "--shard-gpus", "8"]])
def test_contract_keys_and_types(capsys, flags):
    assert main([*DONE_WHEN, *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for k in KEYS[:-1]:
        assert isinstance(out[k], float) and out[k] > 0, k
    assert isinstance(out["meets_requirement"], bool)
    assert out["mode"] == ("sync" if "--sync" in flags else "async")
    assert out["keep"] == (3 if "3" in flags else 2)
    assert out["bytes_per_param"] == (14 if "--bf16-weights" in flags else 12)


def test_sync_stalls_longer_than_async(capsys):
    outs = []
    for mode in ("--async", "--sync"):
        assert main([*DONE_WHEN, mode, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    a, s = outs
    assert s["stall_s"] > 50 * a["stall_s"] and s["ettr"] < a["ettr"]


def test_human_output(capsys):
    assert main(DONE_WHEN) == 0
    text = capsys.readouterr().out
    for word in ("interval", "Young / Daly", "ETTR", "retention", "meets the 30 min limit"):
        assert word in text


def _with(flag, value):
    """The done-when command with one flag's value replaced (or added)."""
    argv = list(DONE_WHEN)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


BAD = [  # (id, argv, fragment of the one-line message)
    ("mtbf-zero", _with("--node-mtbf-hours", "0"), "--node-mtbf-hours: '0'"),
    ("mtbf-negative", _with("--node-mtbf-hours", "-100"), "'-100'"),
    ("mtbf-nan", _with("--node-mtbf-hours", "nan"), "'nan'"),
    ("mtbf-huge", _with("--node-mtbf-hours", "1e300"), "at most"),
    ("mtbf-too-short", _with("--node-mtbf-hours", "0.01"), "too short"),
    ("bandwidth-zero", _with("--write-gbps-per-node", "0"), "--write-gbps-per-node: '0'"),
    ("bandwidth-text", _with("--write-gbps-per-node", "fast"), "'fast' is not a number"),
    ("restart-zero", _with("--restart-minutes", "0"), "--restart-minutes: '0'"),
    ("restart-negative", _with("--restart-minutes", "-5"), "'-5'"),
    ("limit-below-restart", _with("--max-lost-minutes", "5"), "restart alone"),
    ("limit-no-room", _with("--max-lost-minutes", "10.5"), "write faster than"),
    ("keep-one", _with("--keep", "1"), "--keep 1"),
    ("keep-zero", _with("--keep", "0"), "'0'"),
    ("gpus-not-whole-nodes", _with("--gpus", "12"), "--gpus 12"),
    ("unknown-model", _with("--model", "gpt-17"), "gpt-17"),
    ("both-modes", [*DONE_WHEN, "--sync", "--async"], "not allowed with"),
    ("missing-mtbf", [a for a in DONE_WHEN if a not in ("--node-mtbf-hours", "2000")],
     "--node-mtbf-hours"),
    ("shard-gpus-too-many", _with("--shard-gpus", "64"), "--shard-gpus 64"),
    ("copy-rate-with-sync", [*DONE_WHEN, "--sync", "--host-copy-gbps", "5"],
     "--host-copy-gbps 5"),
]
SUBPROCESS = {"mtbf-zero", "bandwidth-zero", "restart-zero", "limit-no-room", "keep-one"}


@pytest.mark.parametrize(("argv", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_in_process(tmp_path, monkeypatch, capsys, argv, fragment):
    monkeypatch.chdir(tmp_path)
    rc = main([*argv, "--json"])
    out, err = capsys.readouterr()
    _refused(subprocess.CompletedProcess([], rc, out, err), tmp_path, fragment)


@pytest.mark.parametrize(("argv", "fragment"), [c[1:] for c in BAD if c[0] in SUBPROCESS],
                         ids=[c[0] for c in BAD if c[0] in SUBPROCESS])
def test_bad_input_real_process(tmp_path, argv, fragment):
    _refused(trainplan_cli(argv, tmp_path), tmp_path, fragment)
