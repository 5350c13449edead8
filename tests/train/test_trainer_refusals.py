"""`trainplan train` refuses weights, checkpoint folders and checkpoints it cannot use in one
line and exit 2: before torchrun starts where the launching process can tell (the
safetensors headers, the folder, the checkpoint's manifest and DCP index), and where only
the ranks can, their own one line without torchrun's traceback. `trainplan export` of a run
whose newest checkpoint does not verify says which one it exported instead.

Two torchrun launches (2 CPU ranks, gloo): the run that makes the checkpoints, and ranks
that refuse weights the launching process was told not to check.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest
from tests.train import test_trainer

from trainplan import cli
from trainplan.bench.ckpt import faults
from trainplan.bench.ckpt import manifest as mf
from trainplan.commands import training

work = test_trainer.work  # the shards of `trainplan data prepare` (BPE of 512 ids), reused
SMALL = ["--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--cpu"]
RANKS = ["--nproc-per-node", "2", "--dp", "2", "--zero", "3"]
STEPS, EVERY = 4, 2


def _train(work: Path, *flags: str, model: str = "tiny.yaml") -> list[str]:
    return ["train", "--model", str(work / model), "--data", str(work / "shards"), *SMALL,
            *RANKS, *flags]


@pytest.fixture(scope="module")
def run(work) -> dict:
    """A run of 4 steps through `trainplan train` (checkpoints at 2 and 4): its stdout and
    stderr, and its checkpoint folder."""
    root = work / "refusals-run"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        mp.setenv("OMP_NUM_THREADS", "1")
        rc = cli.main(_train(work, "--steps", str(STEPS), "--ckpt-dir", str(root),
                             "--ckpt-every", str(EVERY), "--log-every", "1"))
    assert rc == 0, err.getvalue()[-3000:]
    return {"root": root, "out": out.getvalue(), "err": err.getvalue()}


@pytest.fixture
def no_launch(monkeypatch) -> list:
    """torchrun's launches, recorded instead of run."""
    started: list = []
    monkeypatch.setattr(training, "run_torchrun", lambda *a, **k: started.append(a))
    return started


def _one_line(rc: int, err: str, *words: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and err.startswith("trainplan: error:"), err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    for w in words:
        assert w in err, err
    return err


def test_a_run_through_torchrun_shows_its_progress_and_summary(run):
    """The launcher relays the ranks' lines as they come and prints the summary line."""
    assert f"step {STEPS}/{STEPS} | loss" in run["err"], run["err"]
    assert "trainplan ckpt: saved step-000004" in run["err"], run["err"]
    assert f"trained tiny-train to step {STEPS} of {STEPS}" in run["out"], run["out"]
    assert [d.name for _, d in mf.step_dirs(run["root"])] == ["step-000004", "step-000002"]


# ---------------------------------------------------------------- --init-from


def _weights(work: Path, name: str, **change) -> Path:
    """Our tiny model's weights (`change`d spec) exported as a Hugging Face folder."""
    import dataclasses

    from trainplan.bench.harness.model import Transformer
    from trainplan.specs import load_model
    from trainplan.train.export import export_state

    spec = dataclasses.replace(load_model(str(work / "tiny.yaml")), **change)
    out = work / name
    if not out.exists():
        export_state(Transformer(spec, max_seq_len=32).state_dict(), spec, out,
                     max_positions=32)
    return out


@pytest.mark.parametrize("case, words", [
    ("junk", ["junk.safetensors: not a readable safetensors file"]),
    ("missing", ["missing.safetensors: no such file or folder"]),
    ("wider", ["'model.layers.0.mlp.gate_proj.weight' (ours 'layers.0.feed_forward.w1.weight')"
               " is [192, 64], but model 'tiny-train' has [128, 64]"]),
    ("wider-folder", ["config.json: ffn = 192 there, but the model 'tiny-train' has 128"]),
])
def test_init_from_weights_of_no_use_are_refused_before_torchrun(work, tmp_path, capsys,
                                                                no_launch, case, words):
    path = {"junk": tmp_path / "junk.safetensors", "missing": tmp_path / "missing.safetensors",
            "wider": _weights(work, "wider", ffn=192) / "model.safetensors",
            "wider-folder": _weights(work, "wider", ffn=192)}[case]
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    rc = cli.main(_train(work, "--steps", "2", "--init-from", str(path)))
    _one_line(rc, capsys.readouterr().err, str(path.name), *words)
    assert not no_launch


@pytest.mark.parametrize("flag", ["--init-from", "--log-dir", "--export"])
def test_a_name_longer_than_the_system_allows_is_refused_in_one_line(work, tmp_path, capsys,
                                                                     no_launch, flag):
    """A file name of 300 characters (255 is the most): one line naming it, no OSError."""
    name = "a" * 300 + (".safetensors" if flag == "--init-from" else "")
    more = ["--ckpt-dir", str(tmp_path / "ck")] if flag == "--export" else []
    rc = cli.main(_train(work, "--steps", "2", flag, str(tmp_path / name), *more))
    words = [f"{flag} ..."] if flag != "--init-from" else []
    _one_line(rc, capsys.readouterr().err, "a" * 100 + name[300:], "File name too long", *words)
    assert not no_launch and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("field, value", [("mlp", "gelu"), ("norm", "layernorm")])
def test_a_model_export_cannot_write_is_refused_before_torchrun(work, tmp_path, capsys,
                                                                no_launch, field, value):
    """--export of a model without a Llama form: refused before the run, not after it."""
    (tmp_path / "other.yaml").write_text(test_trainer.TINY + f"{field}: {value}\n")
    rc = cli.main(_train(tmp_path, "--steps", "2", "--export", str(tmp_path / "hf"),
                         "--ckpt-dir", str(tmp_path / "ck"), model="other.yaml"))
    _one_line(rc, capsys.readouterr().err, f"{field} = {value!r}")
    assert not no_launch and not (tmp_path / "hf").exists() and not (tmp_path / "ck").exists()


def test_init_from_the_models_own_weights_passes(work, capsys):
    rc = cli.main(_train(work, "--steps", "2", "--dry-run", "--init-from",
                         str(_weights(work, "same"))))
    assert rc == 0, capsys.readouterr().err


# ---------------------------------------------------------------- --ckpt-dir and --resume


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_ckpt_dir_that_is_no_folder_is_refused_before_torchrun(work, tmp_path, capsys,
                                                                no_launch, where):
    (tmp_path / "afile").write_text("mine")
    root = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "ck"
    rc = cli.main(_train(work, "--steps", "2", "--ckpt-dir", str(root)))
    _one_line(rc, capsys.readouterr().err, f"--ckpt-dir {root}", "is not a folder")
    assert not no_launch and (tmp_path / "afile").read_text() == "mine"


def test_resume_with_another_model_is_refused_before_torchrun(run, work, tmp_path, capsys,
                                                              no_launch):
    (work / "wide.yaml").write_text(test_trainer.TINY.replace("hidden: 64", "hidden: 128"))
    root = tmp_path / "ck"
    shutil.copytree(run["root"], root)
    rc = cli.main(_train(work, "--steps", "6", "--ckpt-dir", str(root), "--resume",
                         model="wide.yaml"))
    _one_line(rc, capsys.readouterr().err, "--resume:", "step-000004",
              "tensor 'tok_embeddings.weight' is [512, 64], but model 'tiny-train' has "
              "[512, 128]")
    assert not no_launch
    rc = cli.main(_train(work, "--steps", "6", "--ckpt-dir", str(root), "--resume",
                         "--dry-run"))
    assert rc == 0, capsys.readouterr().err


def test_resume_past_steps_is_refused_before_torchrun(run, work, capsys, no_launch):
    """A checkpoint of step 4 and --steps 2: nothing to train, and not what was meant."""
    rc = cli.main(_train(work, "--steps", "2", "--ckpt-dir", str(run["root"]), "--resume"))
    _one_line(rc, capsys.readouterr().err, "step-000004 was saved at step 4, past --steps 2",
              "--steps 5 or more")
    assert not no_launch
    for steps in ("4", "5"):  # resumed at its last step, or with steps left: accepted
        rc = cli.main(_train(work, "--steps", steps, "--ckpt-dir", str(run["root"]),
                             "--resume", "--dry-run"))
        assert rc == 0, capsys.readouterr().err


def test_a_run_resumed_at_its_last_step_says_so_not_a_nan_loss():
    out = training.format_train({"dry_run": False, "stopped": False, "summary": {
        "model": "tiny-train", "steps": 4, "last_step": 4, "losses": [], "evals": []}})
    assert out == ("tiny-train is already at step 4 of 4 (its checkpoint): nothing left to "
                   "train"), out


# ---------------------------------------------------------------- the ranks' own refusals


@pytest.fixture
def no_signal_handlers(monkeypatch):
    """Keep the test process's SIGTERM and excepthook as they are."""
    import sys

    monkeypatch.setattr(faults.Signals, "install", classmethod(lambda cls: None))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


def _rank(work: Path, *flags: str) -> int:
    """`python -m trainplan.train` as one rank runs it, in this process."""
    from trainplan.train import loop

    return loop.main(["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"),
                      *SMALL, "--zero", "0", *flags])


def test_the_ranks_refuse_a_ckpt_dir_that_is_a_file_in_one_line(work, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    assert _rank(work, "--steps", "2", "--ckpt-dir", str(tmp_path / "afile")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: --ckpt-dir {tmp_path / 'afile'} is not a folder"), err


def test_the_ranks_refuse_to_resume_past_steps_in_one_line(run, work, tmp_path, capsys,
                                                           no_signal_handlers):
    root = tmp_path / "ck"
    shutil.copytree(run["root"], root)
    assert _rank(work, "--steps", "2", "--ckpt-dir", str(root), "--resume") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "error: --resume: step-000004 was saved at step 4, past --steps 2" in err, err


def test_a_ranks_refusal_is_one_line_without_torchruns_traceback(work, tmp_path, capsys,
                                                                 monkeypatch):
    """The launcher's check of --init-from turned off: the ranks meet the junk file, each
    prints its one line and exits 2; `trainplan train` shows that line once, exit 2."""
    from trainplan.commands import training
    from trainplan.train import export

    monkeypatch.setattr(export, "check_weights", lambda spec, path: None)
    launched = []
    run = training.run_torchrun
    monkeypatch.setattr(training, "run_torchrun", lambda *a: launched.append(a) or run(*a))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    rc = cli.main(_train(work, "--steps", "2", "--init-from", str(junk)))
    out, err = capsys.readouterr()
    _one_line(rc, err, f"{junk}: not a readable safetensors file")
    assert out == "" and len(launched) == 1  # the line came from the ranks, through torchrun


def test_only_the_trainers_own_error_line_counts_as_its_refusal():
    from trainplan.proctree import own_error

    assert own_error("error: --steps 2 is bad\n") == "--steps 2 is bad"
    assert own_error("[rank1]: error: --steps 2 is bad") == "--steps 2 is bad"
    assert own_error("ERROR:root:a library's log line") is None
    assert own_error("step 2/4 | loss 5.1") is None and own_error("error: ") is None
    assert own_error("failed: the run ended but its final checkpoint was not saved") is None


# ---------------------------------------------------------------- export


def test_export_of_a_run_whose_newest_checkpoint_is_corrupt_says_so(run, work, tmp_path,
                                                                    capsys):
    root = tmp_path / "ck"
    shutil.copytree(run["root"], root)
    shard = next((root / "step-000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, the size unchanged
    shard.write_bytes(bytes(data))
    rc = cli.main(["export", "--ckpt", str(root), "--model", str(work / "tiny.yaml"),
                   "--out", str(tmp_path / "hf")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() == f"exported {root / 'step-000002'} to {tmp_path / 'hf'}", out
    assert err.count("\n") == 1 and err.startswith("trainplan: warning: exported "
                                                   "step-000002, an older checkpoint"), err
    assert "step-000004: " in err and "sha256 mismatch" in err, err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    rc = cli.main(["export", "--ckpt", str(run["root"]), "--model", str(work / "tiny.yaml"),
                   "--out", str(tmp_path / "hf2")])  # intact: no warning
    out, err = capsys.readouterr()
    assert rc == 0 and err == "" and "step-000004" in out, err


@pytest.mark.parametrize("how", ["step-folder", "run-folder", "link"])
def test_export_into_the_checkpoint_it_reads_is_refused_and_the_checkpoint_kept(
        run, work, tmp_path, capsys, how):
    """--out inside --ckpt (a step folder of it, the run's folder, or by a link to it) would
    put a folder the manifest does not list into the checkpoint: one line, exit 2, nothing
    written; the checkpoint still verifies and exports elsewhere."""
    root = tmp_path / "ck"
    shutil.copytree(run["root"], root)
    (tmp_path / "link").symlink_to(root / "step-000004")
    out = {"step-folder": root / "step-000004" / "hf", "run-folder": root / "hf",
           "link": tmp_path / "link" / "hf"}[how]
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    rc = cli.main(["export", "--ckpt", str(root), "--model", str(work / "tiny.yaml"),
                   "--out", str(out)])
    _one_line(rc, capsys.readouterr().err, f"{out.parent.name}/hf is inside --ckpt ",
              "ck, the checkpoint it is exported from", "name a folder outside it")
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert mf.verify(root / "step-000004")[0] is not None
    rc = cli.main(["export", "--ckpt", str(root), "--model", str(work / "tiny.yaml"),
                   "--out", str(tmp_path / "hf")])
    assert rc == 0, capsys.readouterr().err


def test_export_seq_len_is_bounded_by_the_planners_longest_sequence(run, work, tmp_path,
                                                                    capsys):
    """max_position_embeddings of 1e15 is no model's: refused before anything is read."""
    rc = cli.main(["export", "--ckpt", str(run["root"]), "--model", str(work / "tiny.yaml"),
                   "--out", str(tmp_path / "hf"), "--seq-len", "1e15"])
    _one_line(rc, capsys.readouterr().err, "--seq-len 1000000000000000 is not valid; use 1 to "
              "16,777,216")
    assert not (tmp_path / "hf").exists()
