"""`loader.nearest_existing`, the one check of "can a folder be made at this path" behind
--ckpt-dir, --export, --log-dir (`bench.ckpt.store.check_root`) and `data prepare --out`
(`data.shards._check_out`): the nearest existing folder, whether this user can write in
it, and the OS's reason where a name cannot be looked at; each caller's one line."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from trainplan.bench.ckpt.dcp_io import CheckpointError
from trainplan.bench.ckpt.store import check_root
from trainplan.data import shards
from trainplan.errors import SpecError
from trainplan.loader import fit_line, nearest_existing

NOT_AS_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: os.access "
                             "says every folder is writable")
LONG = "n" * 300  # a name longer than a file system takes (255 bytes)


def test_a_missing_chain_ends_at_the_folder_it_would_be_made_in(tmp_path):
    assert nearest_existing(tmp_path / "a" / "b" / "c") == (tmp_path, None)
    assert nearest_existing(str(tmp_path / "a")) == (tmp_path, None)
    assert nearest_existing(tmp_path) == (tmp_path, None)  # the folder itself exists
    assert not (tmp_path / "a").exists()  # nothing is made


def test_a_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert nearest_existing(Path("a/b")) == (tmp_path, None)


def test_under_a_file_or_a_file_itself_is_not_a_folder(tmp_path):
    (tmp_path / "afile").write_text("mine")
    assert nearest_existing(tmp_path / "afile" / "x" / "y") == (tmp_path / "afile",
                                                                 "not a folder")
    assert nearest_existing(tmp_path / "afile") == (tmp_path / "afile", "not a folder")
    assert (tmp_path / "afile").read_text() == "mine"


@NOT_AS_ROOT
def test_under_a_read_only_folder_is_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    try:
        assert nearest_existing(ro / "x" / "y") == (ro, "not writable")
    finally:
        ro.chmod(0o755)


@NOT_AS_ROOT
def test_under_a_folder_that_cannot_be_searched_gives_the_os_reason(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o600)
    try:
        assert nearest_existing(closed / "x") == (None, "Permission denied")
    finally:
        closed.chmod(0o755)


def test_a_nul_byte_is_not_a_path(tmp_path):
    assert nearest_existing(str(tmp_path / "a\0b")) == (None, "not a path")
    assert nearest_existing(str(tmp_path) + "\0") == (None, "not a path")


@pytest.mark.parametrize("tail", [LONG, f"{LONG}/z"])
def test_a_name_too_long_gives_the_os_reason(tmp_path, tail):
    assert nearest_existing(tmp_path / tail) == (None, "File name too long")


def test_a_name_too_long_below_a_missing_folder_is_not_looked_at(tmp_path):
    """The OS stops at the first missing name; lengths below it are the caller's to check."""
    assert nearest_existing(tmp_path / "a" / LONG) == (tmp_path, None)


def test_a_symlink_loop_gives_the_os_reason(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert nearest_existing(tmp_path / "loop" / "x") == (None, "Too many levels of symbolic "
                                                              "links")


# ---------------------------------------------------------------- the callers' lines


def _says(error, call, pattern: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert re.fullmatch(pattern, str(info.value)), str(info.value)


def test_check_root_lines(tmp_path):
    (tmp_path / "afile").write_text("mine")
    ok = tmp_path / "a" / "ck"
    check_root(ok)
    assert not ok.exists()
    check_root(ok, make=True)
    assert ok.is_dir()
    _says(CheckpointError, lambda: check_root(tmp_path / "afile"),
          r"--ckpt-dir .*/afile is not a folder; name a folder for the run's files \(new, or "
          r"the run's own\)")
    _says(CheckpointError, lambda: check_root(tmp_path / "afile" / "x", flag="--log-dir"),
          r"--log-dir .*/afile/x is in .*/afile, which is not a folder; name a folder for "
          r"the run's files \(new, or the run's own\)")
    for make in (False, True):  # refused before torchrun starts, not only where it is made
        _says(CheckpointError, lambda m=make: check_root(Path(f"{tmp_path}/a\0b"), make=m),
              r"--ckpt-dir .*/a\\x00b cannot be used \(not a path\); name a folder you can "
              r"write to")
    _says(CheckpointError, lambda: check_root(tmp_path / LONG, flag="--export"),
          r"--export \.\.\.n+ cannot be used \(File name too long\); name a folder you can "
          r"write to")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "afile"]


def test_data_prepare_out_lines(tmp_path):
    (tmp_path / "afile").write_text("mine")
    shards._check_out(tmp_path / "a" / "out")
    _says(SpecError, lambda: shards._check_out(tmp_path),
          r"--out '.*' exists; give a new folder \(nothing is overwritten\)")
    _says(SpecError, lambda: shards._check_out(tmp_path / "afile" / "o"),
          r"--out '.*/afile/o': '.*/afile' is not a folder this user can write in; give a "
          r"new folder where one can be made")
    _says(SpecError, lambda: shards._check_out(Path(f"{tmp_path}/o\0x")),
          r"--out '.*/o\\x00x' cannot be used \(not a path\); give a new folder where one "
          r"can be made")
    _says(SpecError, lambda: shards._check_out(tmp_path / LONG / "o"),
          r"--out '.*' cannot be used \(File name too long\); give a new folder where one "
          r"can be made")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@NOT_AS_ROOT
def test_a_read_only_folder_is_refused_by_both_callers(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    try:
        _says(CheckpointError, lambda: check_root(ro / "ck", make=True),
              r"--ckpt-dir .*/ro/ck: cannot write in .*/ro; name a folder you can write to")
        _says(SpecError, lambda: shards._check_out(ro / "out"),
              r"--out '.*/ro/out': '.*/ro' is not a folder this user can write in; give a new "
              r"folder where one can be made")
    finally:
        ro.chmod(0o755)


def test_a_name_with_a_newline_or_nul_stays_on_one_line(tmp_path):
    """`shown` escapes control characters, so a refusal naming such a path is one line."""
    from trainplan.loader import shown

    assert shown("a\nb\x00c\x7fé/d") == "a\\x0ab\\x00c\\x7fé/d"
    with pytest.raises(CheckpointError) as err:
        check_root(tmp_path / "x\ny\x00", make=True)
    assert "\n" not in str(err.value) and "x\\x0ay\\x00" in str(err.value)


def test_a_link_to_nowhere_takes_the_name(tmp_path):
    """A dangling link is no free name: refused up front, not after the work (data prepare
    tokenised the whole corpus before the rename into it failed)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert nearest_existing(tmp_path / "dangling") == (tmp_path / "dangling", "not a folder")
    _says(SpecError, lambda: shards._check_out(tmp_path / "dangling"),
          r"--out '.*/dangling' exists; give a new folder \(nothing is overwritten\)")
    _says(CheckpointError, lambda: check_root(tmp_path / "dangling" / "ck", make=True),
          r"--ckpt-dir .*/dangling/ck is in .*/dangling, which is not a folder; name a folder "
          r"for the run's files \(new, or the run's own\)")
    assert not (tmp_path / "nowhere").exists()


def test_fit_line_keeps_paths_whole_where_the_line_fits_else_shares_the_room():
    parts = ["a ", ("/x/" + "p" * 50,), " b ", ("/y/" + "q" * 50,), " end"]
    whole = fit_line(parts, 300)
    assert whole == f"a /x/{'p' * 50} b /y/{'q' * 50} end"
    cut = fit_line(parts, 60)  # 9 characters of text, 25 for each path's tail
    assert len(cut) <= 60 and cut.startswith("a ...") and cut.endswith(" end")
    assert cut.count("...") == 2 and " b ..." in cut
    assert fit_line(["only text"], 3) == "only text"  # nothing to cut: the caller's limit
