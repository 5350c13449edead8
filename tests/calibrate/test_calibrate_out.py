"""`trainplan calibrate --out` and its inputs: an --out that is an input, is not a regular
file or lies under a file, and a record file given twice, are one line and exit 2, with
nothing written and nothing lost; a link to a regular file is written through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from trainplan.calibrate import store as calibration
from trainplan.cli import main
from trainplan.loader import quote  # the messages quote paths so: long ones lose their middle

MICRO = "data/measurements/validate-h200x4-20261126d/vA/micro.jsonl"  # H200, host benches too
GPU_YAML = ("bf16_tflops: 500\nmemory_gib: 40\nhbm_tbps: 2.0\nmatmul_efficiency: 0.7\n"
            "attention_efficiency: 0.4\nmemory_efficiency: 0.8\n")


@pytest.fixture
def rec(tmp_path) -> Path:
    """A copy of the H200 microbenchmark records, in a folder of its own."""
    path = tmp_path / "rec.jsonl"
    path.write_bytes(Path(MICRO).read_bytes())
    return path


def _refused(capsys, argv, *fragments) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def _listing(folder: Path) -> dict:
    """Each name in `folder` with its kind (a link's target included) and its bytes."""
    def kind(p):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return "link", os.readlink(p)
        return stat.S_IFMT(st.st_mode), p.read_bytes() if stat.S_ISREG(st.st_mode) else None
    return {p.name: kind(p) for p in folder.iterdir()}


@pytest.mark.parametrize("case", ["records", "spelled-otherwise", "link", "host-records",
                                  "gpu-file"])
def test_an_out_that_is_an_input_is_refused_and_the_input_kept(case, rec, tmp_path, capsys):
    (tmp_path / "link.jsonl").symlink_to(rec)
    gpu = tmp_path / "g.yaml"
    gpu.write_text(GPU_YAML)
    argv = ["calibrate", "--records", str(rec), "--gpu", "h200-sxm", "--out", str(rec)]
    given = "--records"
    if case == "spelled-otherwise":
        argv[-1] = f"{tmp_path}/./{rec.name}"
    elif case == "link":
        argv[-1] = str(tmp_path / "link.jsonl")
    elif case == "host-records":
        argv = ["calibrate", "--records", MICRO, "--host-records", str(rec), "--gpu",
                "h200-sxm", "--out", str(rec)]
        given = "--host-records"
    elif case == "gpu-file":
        argv[3:] = ["--gpu", str(gpu), "--out", str(gpu)]
        given = "--gpu"
    before = _listing(tmp_path)
    _refused(capsys, argv, f"--out {quote(argv[-1])} is the input {given}",
             "name another file")
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("case, fragment", [
    ("fifo", "is not a regular file"),
    ("folder", "is a folder"),
    ("link-to-fifo", "is not a regular file"),
    ("link-to-folder", "is a folder"),
    ("link-to-nowhere", "is a link to nowhere"),
])
def test_an_out_that_is_not_a_regular_file_is_left_as_it_is(case, fragment, rec, tmp_path,
                                                             capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "link-to-fifo").symlink_to(tmp_path / "fifo")
    (tmp_path / "link-to-folder").symlink_to(tmp_path / "folder")
    (tmp_path / "link-to-nowhere").symlink_to(tmp_path / "nowhere")
    before = _listing(tmp_path)
    out = str(tmp_path / case)
    _refused(capsys, ["calibrate", "--records", str(rec), "--gpu", "h200-sxm", "--out", out],
             f"--out {quote(out)} {fragment}")
    assert _listing(tmp_path) == before and list((tmp_path / "folder").iterdir()) == []


def test_an_out_under_a_regular_file_is_one_line(rec, tmp_path, capsys):
    """It was a FileExistsError traceback from making the folder, exit 1."""
    keep = tmp_path / "keep.txt"
    keep.write_text("keep\n")
    out = f"{keep}/c.yaml"
    _refused(capsys, ["calibrate", "--records", str(rec), "--gpu", "h200-sxm", "--out", out],
             f"--out {quote(out)}: {quote(str(keep))} is not a folder")
    assert keep.read_text() == "keep\n"


@pytest.mark.parametrize("case", ["records", "link", "committed", "host-records"])
def test_a_records_file_given_twice_is_refused(case, rec, tmp_path, capsys):
    """Twice, its records would be counted twice (254 records labelled from 127)."""
    (tmp_path / "link.jsonl").symlink_to(rec)
    out = tmp_path / "cal.yaml"
    first, second, flag = str(rec), str(rec), "--records"
    argv = ["calibrate", "--records", first, second]
    if case == "link":
        second = str(tmp_path / "link.jsonl")
        argv[-1] = second
    elif case == "committed":  # a file the committed calibration lists, given again
        listed = calibration.committed_sources("h200-sxm")[0]
        first, second = str(listed), MICRO
        argv = ["calibrate", "--committed", "--records", second]
        flag = "--committed"
    elif case == "host-records":
        argv = ["calibrate", "--records", MICRO, "--host-records", first, second]
        flag = "--host-records"
    _refused(capsys, [*argv, "--gpu", "h200-sxm", "--out", str(out)],
             f"{flag} {quote(first)} is given twice (then as",
             f"{quote(second)}): its records would count twice",
             "give each file once")
    assert not out.exists()


def test_a_link_to_a_regular_file_is_written_through(rec, tmp_path, capsys):
    """The link stays, its target gets the calibration; no temporary file is left."""
    target = tmp_path / "target.yaml"
    target.write_text("old\n")
    link = tmp_path / "cal.yaml"
    link.symlink_to(target)
    assert main(["calibrate", "--records", str(rec), "--gpu", "h200-sxm", "--out",
                 str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert calibration.load("h200-sxm", target)["matmul_efficiency"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.yaml", "rec.jsonl",
                                                          "target.yaml"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
