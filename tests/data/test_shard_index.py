"""A prepared folder's index.json is checked when it is read (`data.shard_index`): a
hand-edited or damaged index is one line naming the field, not an IndexError in the model's
embedding many lines later; and where the index cannot say (a folder from before `max_id`),
the ids each window reads are checked against the model's vocabulary."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from trainplan import cli
from trainplan.data import shards
from trainplan.errors import SpecError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Shards of 20 stdlib modules, a BPE of 300 ids, 10% held out."""
    root = tmp_path_factory.mktemp("index")
    (root / "corpus").mkdir()
    for i, f in enumerate(sorted(STDLIB.glob("*.py"))[:20]):
        (root / "corpus" / f"{i:02d}.txt").write_text(f.read_text(errors="replace"))
    shards.prepare([root / "corpus"], root / "shards", vocab_size=300, val_fraction=0.1)
    return root / "shards"


def _edited(prepared: Path, tmp_path: Path, change) -> Path:
    """A copy of the prepared folder whose index `change(index)` edited."""
    folder = tmp_path / "copy"
    shutil.copytree(prepared, folder)
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))
    return folder


def _shard(index, **fields):
    index["splits"]["train"]["shards"][0].update(fields)


def _twice(index):
    train = index["splits"]["train"]
    train["shards"].append(dict(train["shards"][0]))
    train["tokens"] += train["shards"][0]["tokens"]


EDITS = {  # case -> (edit, words of the one line)
    "vocab-true": (lambda i: i.update(vocab_size=True), "vocab_size True is not a whole number"),
    "vocab-float": (lambda i: i.update(vocab_size=300.0), "vocab_size 300.0 is not a whole"),
    "vocab-past-dtype": (lambda i: i.update(vocab_size=70_000), "in 1..65,536 (the ids uint16"),
    "vocab-below-ids": (lambda i: i.update(vocab_size=200),
                        "max_id 299 is not an id of its vocabulary (vocab_size 200)"),
    "eos-past-vocab": (lambda i: i.update(eos_id=70_000), "eos_id 70000 is not an id of its "
                                                          "vocabulary (0..299)"),
    "eos-negative": (lambda i: i.update(eos_id=-1), "eos_id -1 is not an id"),
    "dtype": (lambda i: i.update(dtype="float64"), "dtype 'float64' is not one of"),
    "shard-tokens-negative": (lambda i: _shard(i, tokens=-5), "tokens -5 is not a whole number"),
    "split-tokens-negative": (lambda i: i["splits"]["val"].update(tokens=-5),
                              "split 'val': tokens -5 is not a whole number >= 0"),
    "split-tokens-not-the-sum": (lambda i: i["splits"]["train"].update(tokens=7),
                                 "split 'train': tokens 7 is not the sum of its shards'"),
    "documents-negative": (lambda i: i["splits"]["train"].update(documents=-1),
                           "documents -1 is not a whole number >= 0"),
    "shard-twice": (_twice, "shard 'train-00000.bin' is listed twice"),
    "shard-outside": (lambda i: _shard(i, file="../other/x.bin"),
                      "lists shard '../other/x.bin', not a file name in the folder"),
    "shard-absolute": (lambda i: _shard(i, file="/etc/passwd"), "not a file name in the folder"),
    "shard-not-a-name": (lambda i: _shard(i, file=7), "lists shard 7, not a file name"),
    "max-id-past-vocab": (lambda i: _shard(i, max_id=300), "max_id 300 is not an id"),
    "tokenizer": (lambda i: i.update(tokenizer="tokenizer.json"), "has no sha256"),
}


@pytest.mark.parametrize("case", list(EDITS), ids=list(EDITS))
def test_an_edited_index_is_one_line_naming_the_field(prepared, tmp_path, case):
    edit, words = EDITS[case]
    folder = _edited(prepared, tmp_path, edit)
    with pytest.raises(SpecError) as err:
        shards.open_shards(folder, "train")
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert str(folder / "index.json") in str(err.value)


def test_the_prepared_index_records_each_shards_largest_id(prepared):
    index = json.loads((prepared / "index.json").read_text())
    s = shards.open_shards(prepared, "train", vocab_size=300)
    assert index["splits"]["train"]["shards"][0]["max_id"] == int(s.window(0, s.tokens).max())
    assert s.index["vocab_size"] == 300 and s.index["eos_id"] < 300


def test_without_max_id_the_ids_read_are_checked_against_the_model(prepared, tmp_path):
    """An index from before `max_id`, its vocab_size edited below its ids: it passes the
    index's checks, and the first window read with an id past the model's vocabulary is
    one line (not the embedding's IndexError)."""
    def older(index):
        index["vocab_size"] = 200
        for part in index["splits"].values():
            for s in part["shards"]:
                del s["max_id"]
    folder = _edited(prepared, tmp_path, older)
    s = shards.open_shards(folder, "train", vocab_size=200)
    with pytest.raises(SpecError, match="outside the model's vocabulary of 200 though its "
                                        "index.json says vocab_size 200"):
        s.window(0, s.tokens)
    assert shards.open_shards(folder, "train").window(0, 10).size == 10  # no model: no check


def test_train_refuses_an_edited_index_before_torchrun(prepared, tmp_path, capsys):
    folder = _edited(prepared, tmp_path, lambda i: i.update(vocab_size=True))
    (tmp_path / "m.yaml").write_text("name: m\nn_layers: 1\nhidden: 32\nn_heads: 2\nffn: 64\n"
                                     "vocab: 256\n")
    rc = cli.main(["train", "--model", str(tmp_path / "m.yaml"), "--data", str(folder),
                   "--steps", "2", "--seq-len", "32", "--cpu", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("trainplan: error: ") and "vocab_size True" in err, err
