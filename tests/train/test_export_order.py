"""`trainplan export` checks its cheap arguments (model, --out, --dtype, --seq-len) before it
reads the checkpoint: verifying one hashes every shard, so a typo must not wait for that, and
with a bad model and a bad checkpoint the model is what the one line names."""

from __future__ import annotations

import pytest

from conftest import trainplan_cli
from trainplan.bench.ckpt import manifest as mf
from trainplan.cli import main
from trainplan.train import export

GELU = "n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 128\nvocab: 256\nmlp: gelu\n"


def _reading_forbidden(*args, **kw):
    raise AssertionError(f"the checkpoint was read before the arguments were checked: {args}")


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A bad checkpoint (a step folder whose manifest is junk, beside a large shard) and files
    to point at; every function that reads a checkpoint fails the test if it is called."""
    step = tmp_path / "ckpt" / "step-000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{not json")
    with open(step / "__0_0.distcp", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: hashing it is what verifying would do
    (tmp_path / "gelu.yaml").write_text(GELU)
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "README.md").write_text("mine")
    for name in ("verify", "newest", "step_dirs", "read_manifest", "file_entry"):
        monkeypatch.setattr(mf, name, _reading_forbidden)
    monkeypatch.setattr(export, "checkpoint_folder", _reading_forbidden)
    monkeypatch.chdir(tmp_path)
    return tmp_path


LONG = "a" * 250  # fits the file system, but its temporary folder's name would not
BAD = [  # (id, flags after --ckpt, fragment of the one line)
    ("unknown-model", ["--model", "gpt-17", "--out", "hf"], "unknown model 'gpt-17'"),
    ("moe-model", ["--model", "mixtral-8x7b", "--out", "hf"],
     "model 'mixtral-8x7b': n_experts = 8 has no Hugging Face Llama form"),
    ("gelu-model", ["--model", "gelu.yaml", "--out", "hf"], "mlp = 'gelu'"),
    ("bad-slice", ["--model", "llama-13b:0-layers", "--out", "hf"], "'llama-13b:0-layers'"),
    ("absent-config", ["--model", "nope/config.json", "--out", "hf"], "nope/config.json"),
    ("out-full", ["--model", "llama-1.3b", "--out", "full"],
     "full: exists and is not an empty folder"),
    ("out-a-file", ["--model", "llama-1.3b", "--out", "afile"],
     "afile: exists and is not an empty folder"),
    ("out-under-a-file", ["--model", "llama-1.3b", "--out", "afile/hf"],
     "afile/hf: {tmp}/afile is not a folder this user can write in"),
    ("out-name-too-long", ["--model", "llama-1.3b", "--out", "a" * 300], "File name too long"),
    ("out-name-no-room", ["--model", "llama-1.3b", "--out", LONG],
     "the name is 250 bytes, too long for the temporary folder"),
    ("dtype", ["--model", "llama-1.3b", "--out", "hf", "--dtype", "fp8"], "--dtype: invalid"),
    ("seq-len", ["--model", "llama-1.3b", "--out", "hf", "--seq-len", "0"], "--seq-len: '0'"),
    ("model-and-out", ["--model", "gpt-17", "--out", "full"], "gpt-17"),  # the model first
]


@pytest.mark.parametrize(("flags", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_arguments_are_named_before_the_checkpoint_is_read(work, capsys, flags, fragment):
    before = sorted(p.name for p in work.iterdir())
    rc = main(["export", "--ckpt", str(work / "ckpt"), *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, err)
    assert err.startswith("trainplan: error: ") and err.count("\n") == 1, err
    assert fragment.format(tmp=work) in err, err
    assert "ckpt" not in err.split("error: ", 1)[1]  # the checkpoint is not what it names
    assert sorted(p.name for p in work.iterdir()) == before  # nothing written


@pytest.mark.parametrize("ckpt", ["absent", "ckpt", "ckpt/step-000001"])
def test_a_bad_model_is_named_before_a_bad_checkpoint_in_a_real_process(tmp_path, ckpt):
    (tmp_path / "ckpt" / "step-000001").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-000001" / "manifest.json").write_text("{not json")
    r = trainplan_cli(["export", "--ckpt", tmp_path / ckpt, "--model", "gpt-17", "--out",
                       tmp_path / "hf"], tmp_path)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert "unknown model 'gpt-17'" in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()


def test_good_arguments_still_reach_the_checkpoint(tmp_path, capsys):
    """The bad checkpoint is then what the line names (as before the reordering)."""
    (tmp_path / "ckpt").mkdir()
    rc = main(["export", "--ckpt", str(tmp_path / "ckpt"), "--model", "llama-1.3b", "--out",
               str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'ckpt'}: not a verified checkpoint" in err, err
    assert not (tmp_path / "hf").exists()
