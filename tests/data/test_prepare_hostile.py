"""`trainplan data prepare` on hostile corpora: long runs, long documents, deep or huge JSON
lines, broken Unicode, paths that cannot be used, a stop while it writes. Each is bounded,
one line and exit 2, or a clean stop."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers, processors

from conftest import ROOT, trainplan_cli
from trainplan.cli import main
from trainplan.data import corpus, shards, tokenize
from trainplan.loader import quote


def _refused(argv: list[str], capsys, match: str, out: Path) -> str:
    """Run `trainplan ARGV --out OUT`: exit 2, one line matching `match`, nothing left."""
    assert main([*argv, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(match, err), err
    assert not os.path.exists(out) and not list(out.parent.glob(f".{out.name}.partial-*"))
    return err


def test_the_trained_tokenizer_cuts_long_runs_into_pieces():
    tok = tokenize.train(iter(["some words, and more words"]), 300)
    pieces = tok.pre_tokenizer.pre_tokenize_str("x" * 1000 + " next")
    assert [len(p) for p, _ in pieces] == [256, 256, 256, 232, 5]  # " next": "Ġnext"


def test_megabyte_words_train_and_encode_in_bounded_time(tmp_path):
    words = ["a" * 2**20, "".join(random.Random(0).choices(string.ascii_letters, k=2**20))]
    (tmp_path / "src").mkdir()
    for i, word in enumerate(words):  # a square-time trainer takes minutes on the first
        (tmp_path / "src" / f"w{i}.txt").write_text(word)
    out = tmp_path / "out"
    proc = trainplan_cli(["data", "prepare", tmp_path / "src", "--out", out, "--vocab-size",
                          "400", "--val-fraction", "0", "--no-progress"], cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids = shards.open_shards(out).window(0, shards.open_shards(out).tokens)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    cuts = np.flatnonzero(ids == tok.token_to_id(tokenize.EOS))
    assert [tok.decode(part.tolist()) for part in np.split(ids, cuts + 1)[:-1]] == words


@pytest.mark.parametrize(("line", "match"), [
    ("[" * 100_000, r"x\.jsonl:2 is nested too deeply to read"),
    ('{"text": ' + "[" * 5000 + "]" * 5000 + "}", r"x\.jsonl:2 is nested too deeply"),
    ('{"text": "half a pair \\ud800 here"}', r"x\.jsonl:2 holds '\\ud800' at character 12"),
])
def test_a_bad_json_line_is_named(tmp_path, capsys, line, match):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    _refused(["data", "prepare", str(tmp_path / "src"), "--vocab-size", "300"], capsys, match,
             tmp_path / "out")


def test_a_huge_json_line_is_refused_by_size_reading_a_bounded_part(tmp_path, capsys,
                                                                     monkeypatch):
    reads = []

    class Counted(io.BytesIO):
        def readline(self, size=-1):
            reads.append(len(line := super().readline(size)))
            return line

    monkeypatch.setattr(corpus, "MAX_LINE_BYTES", 4000)
    monkeypatch.setattr(corpus, "_open", lambda path: Counted(path.read_bytes()))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.jsonl").write_text('{"text": "fine"}\n{"text": "' + "y" * 10**6
                                              + '"}\n')
    _refused(["data", "prepare", str(tmp_path / "src"), "--vocab-size", "300"], capsys,
             r"x\.jsonl:2 is a line of more than 4,000 bytes", tmp_path / "out")
    assert reads and max(reads) <= 4001  # the million-byte line was never read whole


def _long_text(chars: int, seed: int = 0) -> str:
    """Text with what pre-tokenizers cut in many ways: lines, blank lines, trailing spaces,
    indents, tabs, contractions, numbers, runs of over 256 bytes, accents and CJK."""
    rng = random.Random(seed)
    words = ["the", "of", "Zoë", "naïve", "中文字", "x=1;", "1234567", "don't", "\t", "  ",
             "<|endoftext|>"] * 3 + ["-" * 300, "é" * 200]
    seps = [" "] * 6 + ["\n", "\n\n", " \n", "\n    ", "  ", "\t"]
    parts, n = [], 0
    while n < chars:
        parts += [rng.choice(words), rng.choice(seps)]
        n += len(parts[-2]) + len(parts[-1])
    return "".join(parts)


def _split_ids(out: Path) -> tuple[list[list[int]], Tokenizer]:
    """The documents of the training split of `out`, as id lists (end-of-document id cut off)."""
    ids = shards.open_shards(out).window(0, shards.open_shards(out).tokens)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    cuts = np.flatnonzero(ids == tok.token_to_id(tokenize.EOS))
    return [part[:-1].tolist() for part in np.split(ids, cuts + 1)[:-1]], tok


@pytest.mark.parametrize(("text", "size", "n"), [
    ("one two\nthree four", 100, 18),  # all of it
    ("one two\nthree four", 12, 8),  # just after the line break
    ("aaa\n\nbbb ccc", 10, 8),  # not in a blank line: just before the last space
    ("aaa \nbbb ccc", 10, 8),  # nor after a trailing space
    ("x" * 30, 10, 10),  # no such place: the size
    (" " + "x" * 30, 10, 10),
])
def test_a_piece_ends_where_a_pre_token_ends(text, size, n):
    assert corpus.cut(text, size) == n


@pytest.mark.parametrize("pre_tokenizer", [
    pre_tokenizers.ByteLevel(add_prefix_space=False),  # GPT-2's pattern
    pre_tokenizers.Split(Regex(  # Llama 3's
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated")])
def test_pieces_pre_tokenize_as_the_whole_text(pre_tokenizer):
    text = _long_text(20_000)
    pieces = list(corpus._split(text, 1000))
    assert "".join(pieces) == text and len(pieces) > 20 and max(map(len, pieces)) <= 1000
    starts = [p[0] for p in pieces[1:]]
    assert "\n" in {p[-1] for p in pieces} and " " in starts  # both kinds of cut
    assert [t for p in pieces for t, _ in pre_tokenizer.pre_tokenize_str(p)] == \
        [t for t, _ in pre_tokenizer.pre_tokenize_str(text)]


def test_a_long_document_encodes_in_pieces_to_the_ids_of_the_whole():
    text = _long_text(30_000)
    tok = tokenize.train(iter([text]), 400)
    pieces = list(corpus._split(text, 1000))
    assert len(pieces) > 25
    assert [i for enc in tok.encode_batch(pieces) for i in enc.ids] == tok.encode(text).ids


def test_long_documents_in_every_format_are_prepared_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_CHARS", 1000)
    reads, pieces = [], []

    class Counted(io.BytesIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    def spied(*args):
        for piece in _pieces(*args):
            pieces.append(len(piece.text))
            yield piece

    _pieces = shards._pieces
    monkeypatch.setattr(shards, "_pieces", spied)
    monkeypatch.setattr(corpus, "_open", lambda path: Counted(path.read_bytes()))
    src = tmp_path / "src"
    src.mkdir()
    docs = ["short", *(_long_text(15_000, seed) for seed in range(3))]
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:2]))
    pq.write_table(pa.table({"text": [docs[2]]}), src / "b.parquet")
    (src / "c.txt").write_bytes(docs[3].replace("\n", "\r\n").encode())  # a text file, read
    out = tmp_path / "out"  # in pieces, its newlines made "\n"
    assert main(["data", "prepare", str(src), "--out", str(out), "--vocab-size", "400",
                 "--val-fraction", "0", "--no-progress"]) == 0
    got, tok = _split_ids(out)
    tok.encode_special_tokens = True
    assert got == [enc.ids for enc in tok.encode_batch(docs)]  # one document each, as a whole
    assert len(pieces) > 40 and max(pieces) <= 1000
    assert min(reads) > 0 and max(reads) <= 1001  # never the whole file at once


def test_a_long_text_file_goes_to_the_split_of_its_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_CHARS", 1000)
    text = _long_text(15_000)
    (tmp_path / "a.txt").write_text(text)
    [doc] = corpus.documents([tmp_path / "a.txt"])
    assert doc.text is None and "".join(doc.pieces()) == text
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    at = int.from_bytes(digest, "big") / 2**64
    assert shards.held_out(doc.pieces(), at * (1 + 1e-9))
    assert not shards.held_out(doc.pieces(), at * (1 - 1e-9))


def test_a_start_of_text_id_comes_once_in_a_document_encoded_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_CHARS", 1000)
    text = _long_text(15_000)
    tok = tokenize.train(iter([text]), 400)
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>")])
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text(text)
    assert main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"),
                 "--tokenizer", str(tmp_path / "tok.json"), "--val-fraction", "0",
                 "--no-progress"]) == 0
    tok.encode_special_tokens = True
    assert _split_ids(tmp_path / "out")[0] == [tok.encode(text).ids]


@pytest.mark.parametrize("chunk", [None, *range(2, 12)])
def test_text_files_keep_universal_newlines(tmp_path, monkeypatch, chunk):
    raw = b"one\r\ntwo\rthree\n" * 3 + "é中\r\n".encode() * 4 + b"\r"
    if chunk:  # read in pieces: a "\r\n" or a character cut by a read
        monkeypatch.setattr(corpus, "CHUNK_CHARS", chunk)
    (tmp_path / "a.txt").write_bytes(raw)
    want = raw.decode().replace("\r\n", "\n").replace("\r", "\n")
    assert ["".join(d.pieces()) for d in corpus.documents([tmp_path / "a.txt"])] == [want]


def test_a_long_text_file_not_utf8_names_the_byte(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_CHARS", 1000)
    (tmp_path / "a.txt").write_bytes(b"a" + "é".encode() * 2500 + b"\xff" + b"x" * 3000)
    _refused(["data", "prepare", str(tmp_path / "a.txt"), "--vocab-size", "300"], capsys,
             r"a\.txt' is not UTF-8 text \(byte 5001\)", tmp_path / "out")


LONG = "x" * 300  # a name longer than a file system takes (255 bytes)


@pytest.mark.parametrize(("where", "says"), [("corpus", "corpus path {} cannot be read"),
                                             ("tokenizer", "--tokenizer {} cannot be read"),
                                             ("out", "--out {} cannot be used")])
def test_a_path_too_long_is_one_line_naming_it(tmp_path, capsys, where, says):
    (tmp_path / "a.txt").write_text("some text")
    bad = tmp_path / LONG
    args = ["data", "prepare", str(bad if where == "corpus" else tmp_path / "a.txt"),
            *(["--tokenizer", str(bad)] if where == "tokenizer" else ["--vocab-size", "300"])]
    _refused(args, capsys, re.escape(says.format(quote(str(bad))) + " (File name too long)"),
             bad if where == "out" else tmp_path / "out")


def test_an_out_name_too_long_for_its_partial_folder_is_refused_first(tmp_path, capsys):
    _refused(["data", "prepare", str(tmp_path / "missing.txt"), "--vocab-size", "300"], capsys,
             r"--out '.*: the name 'y+\.\.\. \(250 bytes\) is too long; at most 2\d\d bytes",
             tmp_path / ("y" * 250))


def test_a_tokenizer_folder_is_named_a_folder(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    _refused(["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path)], capsys,
             re.escape(f"--tokenizer {quote(str(tmp_path))} is a folder; give the "
                       "tokenizer.json file itself"), tmp_path / "out")


def test_an_out_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "file").write_text("")
    _refused(["data", "prepare", str(tmp_path / "a.txt"), "--vocab-size", "300"], capsys,
             r"--out '.*file/o': '.*file' is not a folder this user can write in",
             tmp_path / "file" / "o")


def test_batches_are_bounded_in_characters(monkeypatch):
    monkeypatch.setattr(shards, "BATCH_CHARS", 100)
    docs = [(Path("a"), "x" * n) for n in (60, 30, 20, 500, 10)]
    assert [[len(t) for _, t in b] for b in shards._batches(iter(docs))] == \
        [[60, 30], [20], [500], [10]]


STOPPED = """
import sys, time
from trainplan.data import shards
held_out = shards.held_out
shards.held_out = lambda *a: (time.sleep(0.002), held_out(*a))[1]  # a slow disk, say
from trainplan.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _sigint_default() -> None:
    """In the child before exec: SIGINT as a terminal delivers it, even where this test runs
    as a shell's background job (which starts with SIGINT ignored, and Python keeps that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stopped_prepare(tmp_path, sig) -> str:
    """Send `sig` to a `data prepare` once it has written its first shard; its stderr."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} of the corpus"})
                                         + "\n" for i in range(20_000)))
    tok = tmp_path / "tokenizer.json"
    tokenize.train(iter(["document of the corpus"]), 300, tok)
    proc = subprocess.Popen([sys.executable, "-c", STOPPED, "data", "prepare", str(src),
                             "--out", str(tmp_path / "out"), "--tokenizer", str(tok),
                             "--no-progress"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.partial-*/train-00000.bin")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    # SIGTERM ends it as the signal does without a handler; Ctrl-C as a shell reports SIGINT
    assert proc.returncode == (-sig if sig == signal.SIGTERM else 130), err
    return err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_writing_leaves_no_partial_folder(tmp_path, sig):
    _stopped_prepare(tmp_path, sig)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_finished_run_gives_sigterm_back(tmp_path):
    (tmp_path / "a.txt").write_text("some text to prepare")
    shards.prepare([tmp_path / "a.txt"], tmp_path / "out", vocab_size=300, val_fraction=0.0)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert (tmp_path / "out" / "index.json").is_file()


def test_an_interrupt_is_one_line_not_a_traceback(tmp_path):
    err = _stopped_prepare(tmp_path, signal.SIGINT)
    assert err.strip().splitlines() == ["trainplan: interrupted"], err


def test_a_parquet_file_damaged_part_way_is_one_line(tmp_path, capsys):
    rng = random.Random(0)
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(200)) for _ in range(4000)]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=500, compression="NONE")
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 5000] = b"\xab" * 5000
    path.write_bytes(data)
    _refused(["data", "prepare", str(path), "--vocab-size", "300"], capsys,
             r"c\.parquet' is not a readable parquet file after row [\d,]+ \(",
             tmp_path / "out")
