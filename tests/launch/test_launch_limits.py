"""`trainplan launch` at the edges: an --out the file system cannot hold, restart and timing
flags past their bounds, and more GPUs than page 5's checkpoint plan allows. Each refusal is
one line, exit 2, naming the value and what is valid, with nothing written."""

from __future__ import annotations

import os
import re

import pytest
from tests.launch.helpers import launch

from trainplan import cli
from trainplan.bench.flags import MAX_COLLECTIVE_TIMEOUT_S
from trainplan.errors import TrainplanError
from trainplan.launch import artefacts
from trainplan.launch.artefacts import BOUNDS, LaunchError, LaunchSettings
from trainplan.launch.folder import TEMP_EXTRA, check_out_dir

LA = ["launch", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--cluster", "dgx-h100",
      "--gpus", "8", "--cpu", "--steps", "10", "--target", "torchrun"]
LONG = "n" * 300  # longer than any file system's name (255 bytes)


def _refused(argv, capsys, tmp_path) -> str:
    """The one stderr line of `argv` (exit 2, nothing on stdout, nothing new in tmp_path)."""
    before = sorted(tmp_path.iterdir())
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error: "), err
    assert "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before, "something was written"
    return err.strip()


# ---------------------------------------------------------------- --out


OUT = {  # --out under tmp_path -> the refusal
    "name-too-long": (LONG, r"--out '.*' cannot be used \(File name too long\); name a folder "
                            r"you can write to"),
    "too-long-below-a-new-folder": (f"new/{LONG}", r"--out '.*': the name 'n+\.\.\. \(300 "
                                                   r"bytes\) is too long; at most \d+ bytes here"),
    "no-room-for-the-temporary-folder": ("m" * 250, r"--out '.*': the name 'm+\.\.\. \(250 "
                                                    r"bytes\) is too long; at most \d+ bytes here"),
    "a-new-folder-too-long": (f"{LONG}/out", r"--out '.*' cannot be used \(File name too long\)"),
    "nul-byte": ("a\0b", r"--out '.*a\\x00b' cannot be used \(not a path\); name a folder you "
                         r"can write to"),
    "under-a-file": ("afile/out", r"--out '.*/afile/out': cannot write in '.*/afile' \(Not a "
                                  r"directory\); name a folder you can write to"),
    "a-file": ("afile", r"--out '.*/afile' is a file; name a folder"),
    "parent": ("afolder/..", r"--out '.*/afolder/\.\.' names no folder of its own; name one, "
                             r"e.g\. launch/"),
}


@pytest.mark.parametrize("out", [".", "..", "/"])
@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
def test_an_out_that_names_no_folder_of_its_own_is_one_line(out, force, tmp_path, capsys,
                                                            monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    err = _refused([*LA, "--out", out, *force], capsys, tmp_path)
    assert err == (f"trainplan: error: --out {out!r} names no folder of its own; name one, "
                   "e.g. launch/"), err
    assert list((tmp_path / "here").iterdir()) == []


@pytest.mark.parametrize("case", list(OUT), ids=list(OUT))
def test_an_out_the_file_system_cannot_hold_is_one_line(case, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "afolder").mkdir()
    name, says = OUT[case]
    err = _refused([*LA, "--out", f"{tmp_path}/{name}"], capsys, tmp_path)
    assert re.fullmatch(f"trainplan: error: {says}.*", err), err


def test_the_longest_name_the_temporary_folders_leave_room_for_is_written(tmp_path, capsys):
    """A name of NAME_MAX - TEMP_EXTRA bytes is written, with --force over an old one too (the
    old folder moves to .NAME.old.XXXXXXXX); one byte more is refused before any planning."""
    most = os.pathconf(tmp_path, "PC_NAME_MAX") - TEMP_EXTRA
    name = "x" * most
    for force in ([], ["--force"]):
        assert cli.main([*LA, "--out", str(tmp_path / name), *force]) == 0, capsys.readouterr()
        assert (tmp_path / name / "torchrun.sh").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [name], "temporary folders left behind"
    with pytest.raises(TrainplanError, match=f"is too long; at most {most} bytes"):
        check_out_dir(tmp_path / (name + "x"), force=False)


def test_a_long_out_in_a_real_process(tmp_path):
    proc = launch([*LA[1:], "--out", tmp_path / LONG], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot be used (File name too long)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- restart and timing flags


LIMITS = [  # (flag, value given, value shown, valid range)
    ("--collective-timeout-s", "9e15", "9000000000000000", "1-604800 (up to 7 days)"),
    ("--collective-timeout-s", "604801", "604801", "1-604800 (up to 7 days)"),
    ("--join-timeout-s", "9007199254740992", "9007199254740992", "1-604800 (up to 7 days)"),
    ("--join-timeout-s", "604801", "604801", "1-604800 (up to 7 days)"),
    ("--save-grace-s", "1e9", "1000000000", "1-604800 (up to 7 days)"),
    ("--save-grace-s", "604801", "604801", "1-604800 (up to 7 days)"),
    ("--max-restarts", "10001", "10001", "0-10000 (restarts of all workers)"),
    ("--max-restarts", "2**53", "9007199254740992", "0-10000 (restarts of all workers)"),
]


@pytest.mark.parametrize(("flag", "text", "shown", "valid"), LIMITS,
                         ids=[f"{f}={t}" for f, t, _, _ in LIMITS])
def test_restart_and_timing_flags_past_their_bound_are_one_line(flag, text, shown, valid,
                                                               tmp_path, capsys):
    text = str(2**53) if text == "2**53" else text
    for target in ("torchrun", "slurm", "k8s"):
        argv = [*LA[:-1], target, flag, text, "--out", str(tmp_path / "out")]
        err = _refused(argv, capsys, tmp_path)
        assert err == f"trainplan: error: {flag} {shown} is not valid; use {valid}", err


@pytest.mark.parametrize("name", list(BOUNDS))
def test_both_ends_of_each_bound_are_valid_and_one_past_is_not(name):
    least, most, _ = BOUNDS[name]
    for value in (least, most):
        LaunchSettings(target="k8s", **{name: value})
    flag = "--" + name.replace("_", "-")
    for value in (least - 1, most + 1):
        with pytest.raises(LaunchError, match=f"^{flag} {value} is not valid; use {least}-"):
            LaunchSettings(target="k8s", **{name: value})


def test_launch_allows_the_timeout_the_launched_module_takes():
    """The bound is the harness's and trainer's own (`bench.flags`): at it, both take the
    flag; past it, both refuse it in their parser."""
    assert BOUNDS["collective_timeout_s"][1] == MAX_COLLECTIVE_TIMEOUT_S == 7 * 24 * 3600
    base = ["--model", "llama-1.3b", "--steps", "2", "--cpu"]
    for trainer in (False, True):
        args = base + (["--data", "shards"] if trainer else [])
        assert artefacts.harness_refusal(
            [*args, "--collective-timeout-s", str(MAX_COLLECTIVE_TIMEOUT_S)], trainer) is None
        why = artefacts.harness_refusal([*args, "--collective-timeout-s", "9e15"], trainer)
        assert why == ("argument --collective-timeout-s: '9e15' is not valid; use a number of "
                       "seconds > 0, at most 604800 (7 days)"), why


# ---------------------------------------------------------------- page 5's checkpoint plan


@pytest.mark.parametrize(("gpus", "nodes"), [(80_000, "10,000"), (100_000, "12,500")])
def test_more_gpus_than_page_5_plans_name_the_gpus_launch_can_use(gpus, nodes, tmp_path,
                                                                 capsys):
    """The node MTBF and restart are page 5's assumptions, not launch flags: the line names
    the GPU count and the most that plan, not --node-mtbf-hours or a faster restart."""
    argv = [*LA, "--gpus", str(gpus), "--global-batch-tokens", str(gpus * 4096),
            "--out", str(tmp_path / "out")]
    err = _refused(argv, capsys, tmp_path)
    assert err.startswith(f"trainplan: error: gpus {gpus} is too many to checkpoint: at page "
                          f"5's conservative node MTBF (1,536 h) its {nodes} nodes fail every ")
    assert re.search(r"; use at most [\d,]+ GPUs \(launch --gpus N, runbook -p gpus=N\)$", err)
    assert "--node-mtbf-hours" not in err and "faster restart" not in err


def test_a_failed_replace_with_force_puts_the_old_folder_back(tmp_path, monkeypatch):
    """--force moves the old folder aside, then renames the new one in; where that second
    rename fails the old folder comes back as it was and nothing else is left beside it."""
    from trainplan.launch import folder

    out = tmp_path / "job"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    real = os.rename

    def rename(src, dst):  # the new folder's rename fails; the old one's way back does not
        if str(dst) == str(out) and ".old." not in str(src):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    made = type("Launch", (), {"files": {"torchrun.sh": "echo new\n"}})()
    monkeypatch.setattr(folder.os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        folder.write(made, out, force=True)
    monkeypatch.setattr(folder.os, "rename", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
