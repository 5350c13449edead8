"""`trainplan train` stopped from outside, and the ranks' output on the way back.

The launcher reads the ranks' stderr through a pipe. A SIGTERM to its process group (Slurm,
`timeout`, `kill -TERM -PGID`) is passed on to torchrun while the launcher waits and relays,
so the ranks' emergency checkpoint is taken and reported; SIGINT ends in `trainplan:
interrupted` (130) once torchrun has stopped. A rank whose stderr reader is gone writes on
to nowhere, and no log line can remove a committed checkpoint. Progress shows as it comes
(`\r` updates too); a rank's refusal is its one line, and a run that failed shows all it
printed, its `failed: ` line included.

One torchrun launch (1 CPU rank, stopped by SIGTERM to its process group); the rest run a
rank in one process, or a stand-in for torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from tests.train import test_trainer
from torch import nn

from trainplan import cli
from trainplan.bench.ckpt import faults
from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt import store as ckpt
from trainplan.bench.harness.parallelize import Parallelized
from trainplan.commands import training
from trainplan.proctree import own_error

work = test_trainer.work  # the shards of `trainplan data prepare` (BPE of 512 ids), reused
SMALL = ["--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--cpu"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
    [str(test_trainer.LIB), os.environ.get("PYTHONPATH", "")]))
WAIT_S = 120  # for a first progress line, or for a stopped run to end: generous bounds


class Lines:
    """A pipe's lines, read on a thread; `wait_for` a line that holds some text."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(pipe), daemon=True)
        self.thread.start()

    def wait_for(self, text: str, proc: subprocess.Popen) -> bool:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if any(text in ln for ln in list(self.lines)):
                return True
            time.sleep(0.05)
        return any(text in ln for ln in list(self.lines))

    @property
    def text(self) -> str:
        self.thread.join(10)
        return "".join(self.lines)


def _kill_left(marker: str) -> list[int]:
    """Kill the processes whose command line holds `marker` (a test's own folder)."""
    left = [p for p in psutil.process_iter(["cmdline"])
            if any(marker in part for part in p.info["cmdline"] or ())]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in left]


def _train_argv(work: Path, root: Path) -> list[str]:
    return ["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"), *SMALL,
            "--log-every", "1", "--ckpt-dir", str(root), "--ckpt-every", "1000",
            "--steps", "100000"]


def test_sigterm_to_the_launchers_group_stops_with_the_emergency_checkpoint(work, tmp_path):
    """As Slurm or `timeout` stop a job: SIGTERM to the launcher's whole process group while
    it trains. The launcher lives on until torchrun has stopped the rank, relays its lines,
    and says where to resume; the rank's checkpoint of the step it stopped at verifies."""
    root = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "trainplan.cli", "train",
                             *_train_argv(work, root)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    err, out = Lines(proc.stderr), Lines(proc.stdout)
    try:
        assert err.wait_for("step 1/100000 | loss", proc), err.text[-3000:]
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        left = _kill_left(str(root))
    text = err.text
    saved = [d for _, d in mf.step_dirs(root)] if root.is_dir() else []
    assert proc.returncode == 143 and len(saved) == 1, (proc.returncode, saved, text[-3000:])
    step = int(saved[0].name.split("-")[1])
    assert mf.verify(saved[0])[0] is not None, text[-3000:]
    assert f"trainplan ckpt: saved {saved[0].name} (" in text and "SIGTERM)" in text, text
    assert out.text.strip() == (f"stopped at step {step} of 100000 with a checkpoint; run the "
                                "same command with --resume to continue"), out.text
    assert not left, f"processes left running: {left}"


def test_a_rank_whose_stderr_reader_died_still_saves_on_sigterm(work, tmp_path):
    """The rank of `python -m trainplan.train` (no torchrun) with its stderr pipe closed by
    the reader after the first progress line: it trains on, writing to nowhere, and SIGTERM
    still takes its emergency checkpoint and ends it with 143 and its summary."""
    root = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "trainplan.train", *_train_argv(work, root),
                             "--json"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        first = ""
        while "step 1/100000" not in first and time.monotonic() < deadline:
            first = proc.stderr.readline()
            assert first or proc.poll() is None, f"the rank ended: {proc.returncode}"
        proc.stderr.close()  # the reader is gone: the rank's next writes meet a broken pipe
        time.sleep(1.0)  # a few more steps, each with its progress line
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=WAIT_S)[0]
    finally:
        proc.kill()
    saved = [d for _, d in mf.step_dirs(root)]
    assert proc.returncode == 143 and len(saved) == 1, (proc.returncode, saved, first)
    assert mf.verify(saved[0])[0] is not None
    summary = json.loads(out.splitlines()[-1])
    assert summary["preempted"] and summary["checkpoint"]["emergency"][0]["ok"], summary


class Broken(io.StringIO):
    """A stream whose reader is gone."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_output_survives_its_reader(monkeypatch):
    from trainplan.proctree import survive_closed_output

    monkeypatch.setattr(sys, "stderr", Broken())
    monkeypatch.setattr(sys, "stdout", Broken())
    survive_closed_output()
    print("step 3/9 | loss 4.2", file=sys.stderr, flush=True)  # to os.devnull, no error
    print('{"summary": 1}', flush=True)
    assert sys.stderr.write("more") == 4


@pytest.fixture
def no_signal_handlers(monkeypatch):
    """Keep the test process's SIGTERM and excepthook as they are."""
    monkeypatch.setattr(faults.Signals, "install", classmethod(lambda cls: None))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


def test_a_log_line_that_fails_never_removes_the_committed_checkpoint(tmp_path, monkeypatch,
                                                                     no_signal_handlers):
    """`saved step-...`, said after the manifest's rename, raises: the checkpoint stays."""
    parser = argparse.ArgumentParser()
    ckpt.add_arguments(parser)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    saver = ckpt.Checkpointer(parser.parse_args(["--ckpt-dir", str(tmp_path)]),
                              Parallelized(parts=[model]), opt, rank=0, world=1,
                              device=torch.device("cpu"))
    with monkeypatch.context() as mp:
        mp.setattr(sys, "stderr", Broken())
        with contextlib.suppress(OSError):  # the log line's error may surface: not the save's
            saver.save(3)
        saver.join_prune()
    assert mf.verify(tmp_path / "step-000003")[0]["step"] == 3


# ---------------------------------------------------------------- the relay of stderr


class Seen(io.StringIO):
    """Our stderr, recorded; `then(text, act)` runs `act` once `text` has been written."""

    def __init__(self):
        super().__init__()
        self.hooks: list = []

    def then(self, text: str, act) -> None:
        self.hooks.append((text, act))

    def write(self, text):
        n = super().write(text)
        for hook in list(self.hooks):
            if hook[0] in self.getvalue():
                self.hooks.remove(hook)
                hook[1]()
        return n


def _stand_in(script: str) -> list[str]:
    """A command that plays torchrun's part: `script` in Python."""
    return [sys.executable, "-c", script]


def test_progress_shows_as_it_comes_not_a_line_late(tmp_path, monkeypatch):
    """A `\\r` update is shown before the next arrives: the stand-in waits (at most 5 s)
    for its first update to be shown before it writes the second."""
    flag = tmp_path / "shown"
    seen = Seen()
    seen.then("step 1/2", flag.touch)
    monkeypatch.setattr(sys, "stderr", seen)
    script = (f"import os, sys, time\nflag = {str(flag)!r}\n"
              "sys.stderr.write('\\rstep 1/2 | loss 5.0'); sys.stderr.flush()\n"
              "end = time.monotonic() + 5\n"
              "while not os.path.exists(flag) and time.monotonic() < end: time.sleep(0.02)\n"
              "sys.stderr.write('\\rstep 2/2 | loss 4.0\\n')\n"
              "sys.exit(0 if os.path.exists(flag) else 3)\n")
    rc, lines, refusal = training.run_torchrun(_stand_in(script), ENV)[:3]
    assert (rc, lines, refusal) == (0, [], None), seen.getvalue()
    assert seen.getvalue() == "\rstep 1/2 | loss 5.0\rstep 2/2 | loss 4.0\n"


def test_a_refusal_read_in_pieces_is_its_one_line(monkeypatch):
    seen = Seen()
    monkeypatch.setattr(sys, "stderr", seen)
    line = "--init-from x: not a readable safetensors file"
    script = ("import sys, time\n"
              "sys.stderr.write('step 1/2 | loss 5.0\\n[rank0]: err'); sys.stderr.flush()\n"
              "time.sleep(0.2)\n"
              f"sys.stderr.write('or: {line}\\n[rank1]: error: {line}\\n'\n"
              "                 'Traceback (most recent call last):\\nChildFailedError:\\n')\n"
              "sys.exit(1)\n")
    rc, _, refusal = training.run_torchrun(_stand_in(script), ENV)[:3]
    assert rc == 1 and refusal == line, refusal
    assert seen.getvalue() == "step 1/2 | loss 5.0\n", seen.getvalue()


def test_a_failed_run_is_no_refusal_and_shows_all_it_printed(work, tmp_path, monkeypatch,
                                                            no_signal_handlers, capsys):
    """A rank whose final checkpoint fails (an injected ENOSPC) exits 1 with its `failed: `
    line, which is no refusal; through the launcher every line after it shows too, and the
    launcher's one line says the trainer failed."""
    from trainplan.train import loop

    monkeypatch.setenv(faults.ENV, "oserror@save:writing:step:2")
    rc = loop.main(["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"), *SMALL,
                    "--steps", "2", "--ckpt-dir", str(tmp_path / "ck")])
    monkeypatch.delenv(faults.ENV)
    err = capsys.readouterr().err
    ends = [ln for ln in err.splitlines() if "final checkpoint was not saved" in ln]
    assert rc == 1 and len(ends) == 1 and ends[0].startswith("failed: "), err
    assert not [ln for ln in err.splitlines() if own_error(ln)], err

    script = (f"import sys\nsys.stderr.write({ends[0]!r} + '\\n' + 'Traceback (most recent "
              "call last):\\nChildFailedError: trainplan.train FAILED\\n')\nsys.exit(1)\n")
    monkeypatch.setattr(training, "command", lambda args: _stand_in(script))
    rc = cli.main(["train", "--model", str(work / "tiny.yaml"), "--data", str(work / "shards"),
                   *SMALL, "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(ends[0] + "\nTraceback (most recent call last):\n"
                                      "ChildFailedError: trainplan.train FAILED\n"), err
    assert err.splitlines()[-1].startswith("trainplan: error: the trainer exited with code 1"), err


def test_ctrl_c_lets_torchrun_stop_its_ranks_then_says_interrupted(work, monkeypatch):
    """SIGINT to the launcher goes on to torchrun (here its stand-in, which takes 0.5 s to
    stop), whose last lines show before `trainplan: interrupted` and exit 130."""
    seen = Seen()
    seen.then("stand-in: ready", lambda: os.kill(os.getpid(), signal.SIGINT))
    monkeypatch.setattr(sys, "stderr", seen)
    script = ("import signal, sys, time\n"
              "got = []\nsignal.signal(signal.SIGINT, lambda s, f: got.append(s))\n"
              "sys.stderr.write('stand-in: ready\\n'); sys.stderr.flush()\n"
              "end = time.monotonic() + 10\n"
              "while not got and time.monotonic() < end: time.sleep(0.02)\n"
              "time.sleep(0.5)\n"
              "sys.stderr.write(f'stand-in: stopped its ranks after signal {got}\\n')\n"
              "sys.exit(1)\n")
    monkeypatch.setattr(training, "command", lambda args: _stand_in(script))
    rc = cli.main(["train", "--model", str(work / "tiny.yaml"), "--data", str(work / "shards"),
                   *SMALL, "--steps", "2"])
    text = seen.getvalue()
    assert rc == 130, text
    assert text.endswith(f"stand-in: stopped its ranks after signal [{int(signal.SIGINT)}]\n"
                         "trainplan: interrupted\n"), text


def test_a_stop_whose_emergency_checkpoint_failed_says_so():
    out = {"dry_run": False, "stopped": True, "summary": {
        "last_step": 7, "steps": 10, "preempted": True, "checkpoint": {"last_committed": 4}}}
    assert training.format_train(out) == (
        "stopped at step 7 of 10, its checkpoint not saved (the FAILED line above); run the "
        "same command with --resume to continue from the newest committed (step 4)")
    out["summary"]["checkpoint"]["last_committed"] = 7
    assert training.format_train(out).startswith("stopped at step 7 of 10 with a checkpoint;")
