"""The checkpoint group's edges: --collective-timeout-s past its bound (`bench.flags`) and the
free space of a checkpoint folder whose name cannot be looked at (`bench.ckpt.disk`). Each
refusal is one line, exit 2 (or one TrainplanError), naming the value and what is valid."""

from __future__ import annotations

import argparse
import shutil

import pytest

from trainplan import cli
from trainplan.bench.ckpt import store
from trainplan.bench.ckpt.dcp_io import CheckpointError
from trainplan.bench.ckpt.disk import free_bytes
from trainplan.bench.flags import MAX_COLLECTIVE_TIMEOUT_S
from trainplan.errors import TrainplanError

TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
RANGE = "is not valid; use a number of seconds > 0, at most 604800 (7 days)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def _one_line(argv, capsys) -> str:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("text", ["9e15", "604801", "inf", "1e400"])
@pytest.mark.parametrize("verb", ["bench", "train"])
def test_a_timeout_past_a_week_is_refused_by_the_harness_and_the_trainer(verb, text, tiny,
                                                                         tmp_path, capsys):
    argv = (["bench", "--model", tiny, "--cpu", "--dry-run", "--", "--collective-timeout-s",
             text] if verb == "bench" else
            ["train", "--model", tiny, "--data", str(tmp_path), "--cpu", "--dry-run",
             "--collective-timeout-s", text])
    err = _one_line(argv, capsys)
    assert f"argument --collective-timeout-s: '{text}' {RANGE}" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", [str(MAX_COLLECTIVE_TIMEOUT_S), "1800", "0.5"])
def test_a_timeout_up_to_a_week_is_taken(text, tiny, capsys):
    assert cli.main(["bench", "--model", tiny, "--cpu", "--dry-run", "--json", "--",
                     "--collective-timeout-s", text]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("text", "says"), [("nan", "--collective-timeout-s = nan must be"),
                                            ("0", "--collective-timeout-s = 0.0 must be"),
                                            ("abc", "'abc' is not a number of seconds")])
def test_other_bad_timeouts_keep_their_lines(text, says, tiny, capsys):
    err = _one_line(["bench", "--model", tiny, "--cpu", "--dry-run", "--",
                     "--collective-timeout-s", text], capsys)
    assert says in err, err


# ---------------------------------------------------------------- free space


def test_free_bytes_of_a_folder_yet_to_be_made_is_its_nearest_parent_s(tmp_path):
    assert free_bytes(tmp_path / "a" / "b") == pytest.approx(
        shutil.disk_usage(tmp_path).free, rel=0.01)


@pytest.mark.parametrize(("name", "why"), [("n" * 300, "File name too long"),
                                           ("n" * 300 + "/ck", "File name too long"),
                                           ("a\0b", "not a path")])
def test_free_bytes_of_a_name_that_cannot_be_looked_at_is_one_line(name, why, tmp_path):
    with pytest.raises(TrainplanError) as err:
        free_bytes(f"{tmp_path}/{name}")
    text = str(err.value)
    assert "\n" not in text and text.endswith(f" cannot be used ({why}); name a folder you can "
                                              "write to"), text
    assert str(tmp_path) in text or text.startswith("..."), text


def test_check_args_holds_the_bound_where_args_skip_the_parser():
    """Args built without the flag's parser (a config, a caller) meet the same bound."""
    parser = argparse.ArgumentParser()
    store.add_arguments(parser)
    args = parser.parse_args(["--ckpt-dir", "d"])
    args.collective_timeout_s = 9e15
    with pytest.raises(CheckpointError, match="at most 604800"):
        store.check_args(args)
    args.collective_timeout_s = float(MAX_COLLECTIVE_TIMEOUT_S)
    store.check_args(args)
