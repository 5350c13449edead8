"""`trainplan data prepare` and the shard reader: a real tokenizer, real files, exact ids."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from trainplan.cli import main
from trainplan.data import shards, tokenize
from trainplan.errors import SpecError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _docs(n: int, skip: int = 0) -> list[str]:
    """`n` documents of real text: standard-library modules (every machine has them)."""
    files = sorted(STDLIB.glob("*.py"))[skip:skip + n]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A folder with a JSONL file, a parquet file and two text files; the documents in the
    order the corpus reader yields them (files sorted, then lines/rows)."""
    root = tmp_path_factory.mktemp("corpus")
    jl, pq_docs, txt = _docs(12), _docs(6, skip=12), _docs(2, skip=18)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                                          for i, d in enumerate(jl)) + "\n")
    pq.write_table(pa.table({"text": pq_docs}), root / "b.parquet")
    for i, d in enumerate(txt):
        (root / f"c{i}.txt").write_text(d)
    (root / "empty.txt").write_text("   \n")
    return root, jl + pq_docs + txt


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("p") / "shards"
    return out, shards.prepare([corpus[0]], out, vocab_size=600, val_fraction=0.2)


def test_every_document_comes_back_exactly_from_the_shards(corpus, prepared):
    out, index = prepared
    _, docs = corpus
    assert index["dtype"] == "uint16" and index["vocab_size"] == 600
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = index["eos_id"]
    got = []
    for split in shards.SPLITS:
        ids = shards.open_shards(out, split).window(0, index["splits"][split]["tokens"])
        cuts = np.flatnonzero(ids == eos)
        assert len(cuts) == index["splits"][split]["documents"] and cuts[-1] == len(ids) - 1
        got += [(split, tok.decode(part.tolist())) for part in np.split(ids, cuts + 1)[:-1]]
    want = {d for d in docs}
    assert {text for _, text in got} == want  # byte-level BPE: exact round trip
    assert sum(index["splits"][s]["documents"] for s in shards.SPLITS) == len(docs)
    held = {text for split, text in got if split == "val"}
    assert held == {d for d in docs if shards.held_out(d, 0.2)} and held  # by text alone
    assert index["sources"][-1] == {"path": str(corpus[0] / "empty.txt"), "documents": 0}


def test_a_given_tokenizer_gives_the_same_shards(corpus, prepared, tmp_path):
    out, index = prepared
    again = shards.prepare([corpus[0]], tmp_path / "again", tokenizer=out / "tokenizer.json",
                           val_fraction=0.2)
    assert again["splits"] == index["splits"]  # shard hashes included
    assert again["tokenizer"]["sha256"] == index["tokenizer"]["sha256"]


def test_shards_split_at_the_size_and_read_across(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "SHARD_TOKENS", 5000)
    index = shards.prepare([corpus[0]], tmp_path / "s", vocab_size=600, val_fraction=0.0)
    files = index["splits"]["train"]["shards"]
    assert len(files) > 3 and all(f["tokens"] == 5000 for f in files[:-1])
    s = shards.open_shards(tmp_path / "s")
    whole = np.concatenate([np.asarray(a, dtype=np.int64) for a in s.arrays])
    assert np.array_equal(s.window(4990, 30), whole[4990:5020])
    with pytest.raises(IndexError):
        s.window(s.tokens - 5, 10)


def test_the_reader_refuses_other_tokenizers_small_models_and_damage(prepared, tmp_path):
    out, index = prepared
    other = tmp_path / "other.json"
    tokenize.train(iter(_docs(3)), 300, other)
    with pytest.raises(SpecError, match="another tokenizer"):
        shards.open_shards(out, tokenizer=other)
    with pytest.raises(SpecError, match="more than the model's vocabulary of 512"):
        shards.open_shards(out, vocab_size=512)
    assert shards.open_shards(out, tokenizer=out / "tokenizer.json", vocab_size=600).tokens
    with pytest.raises(SpecError, match="not a trainplan-token-shards folder"):
        shards.open_shards(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in out.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "train-00000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(SpecError, match="missing or not"):
        shards.open_shards(broken)


def test_large_vocabularies_take_32_bits():
    assert shards.dtype_for(2**16) == "uint16" and shards.dtype_for(2**16 + 1) == "uint32"


@pytest.mark.parametrize(("setup", "args", "match"), [
    (None, ["nowhere"], "does not exist"),
    ("empty", ["DIR"], "no document for the training split"),
    ("badjson", ["DIR"], r"x.jsonl:2 is not a JSON object"),
    ("nofield", ["DIR"], "no string field 'text'"),
    ("latin1", ["DIR"], "not UTF-8 text"),
    ("csv", ["DIR/x.csv"], "suffix '.csv'"),
    ("ok", ["DIR", "--tokenizer", "t.json"], "--tokenizer 't.json': no such file"),
    ("ok", ["DIR", "--vocab-size", "100"], "--vocab-size 100 is not valid"),
    ("ok", ["DIR", "--vocab-size", "300", "--tokenizer", "t.json"], "not both or neither"),
    ("ok", ["DIR", "--vocab-size", "300", "--val-fraction", "1.5"], "not a fraction"),
    ("ok", ["DIR", "--tokenizer", "DIR/a.txt"], "not a tokenizers tokenizer.json"),
    ("ok", ["DIR", "--text-field", "body"], "--text-field 'body' names a JSONL key"),
    ("ok", ["DIR", "DIR"], r"a.txt' is given twice .*: its documents would count twice"),
    ("ok", ["DIR", "DIR/a.txt"],
     r"src/a.txt' is given twice \(in '.*src', then as '.*src/a.txt' in '.*src/a.txt'\)"),
    ("ok", ["DIR/a.txt", "DIR/./a.txt"], "is given twice"),
    ("twokeys", ["DIR"], r"x.jsonl:2 refused: key 'text' given twice"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, setup, args, match):
    src = tmp_path / "src"
    src.mkdir()
    files = {"empty": {"a.txt": ""}, "badjson": {"x.jsonl": '{"text": "a"}\n{oops\n'},
             "nofield": {"x.jsonl": '{"body": "a"}\n'}, "csv": {"x.csv": "a,b\n"},
             "twokeys": {"x.jsonl": '{"text": "a"}\n{"text": "b", "text": "c"}\n'},
             "ok": {"a.txt": "some text"}}.get(setup, {})
    for name, text in files.items():
        (src / name).write_text(text)
    if setup == "latin1":
        (src / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    out = tmp_path / "out"
    argv = ["data", "prepare", *[a.replace("DIR", str(src)) for a in args], "--out", str(out),
            "--no-progress"]
    if "--tokenizer" not in args and "--vocab-size" not in args:
        argv += ["--vocab-size", "300"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err), err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_an_existing_folder_is_never_overwritten(prepared, capsys):
    out, _ = prepared
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    assert main(["data", "prepare", str(out), "--out", str(out), "--vocab-size", "300"]) == 2
    assert "exists" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before


def test_the_command_prints_a_summary_and_json(corpus, tmp_path, capsys):
    assert main(["data", "prepare", str(corpus[0]), "--out", str(tmp_path / "o"),
                 "--vocab-size", "400", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vocab_size"] == 400 and out["splits"]["train"]["tokens"] > 10_000
    assert json.loads((tmp_path / "o" / "index.json").read_text())["splits"] == out["splits"]


def test_a_folder_given_again_through_a_link_is_refused(tmp_path, capsys):
    """The same files under two names (a link to the folder) would count every document
    twice: one line naming both, exit 2, nothing written."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text")
    (tmp_path / "again").symlink_to(tmp_path / "src")
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "again"), "--out",
                 str(tmp_path / "out"), "--vocab-size", "300", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is given twice" in err and "again/a.txt" in err, err
    assert not (tmp_path / "out").exists()
