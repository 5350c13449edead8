"""Instruction records: made from stdlib-like source, deterministic per seed, read and written
as JSON lines; bad files are one line (library) and exit 2 (the CLI), nothing written."""

from __future__ import annotations

import json

import pytest

from trainplan.cli import main
from trainplan.data import instruct
from trainplan.errors import SpecError

SOURCE = {
    "pkg/__init__.py": '"""A package for tests."""\n',
    "pkg/shapes.py": '''"""Shapes and their areas."""


def area(width, height=1):
    """Return the area of a rectangle.

    Width and height are in metres.
    """
    return width * height


class Square:
    """A square of one side."""

    def __init__(self, side):
        self.side = side

    def grow(self, by):
        """Make the square larger by `by`."""
        self.side += by
        return self.side

    def abstract(self):
        """Only a docstring: nothing to write or explain."""
''',
    "pkg/latin1.py": None,  # not UTF-8: left out
    "test/test_skip.py": 'def f():\n    """Never read."""\n    return 1\n',
}


@pytest.fixture
def root(tmp_path):
    base = tmp_path / "lib"
    for rel, body in SOURCE.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        if body is None:
            (base / rel).write_bytes(b'def g():\n    """caf\xe9"""\n    return 2\n')
        else:
            (base / rel).write_text(body, encoding="utf-8")
    return base


def test_records_come_from_documented_code_and_the_reference_topics(root):
    recs = instruct.stdlib_records(0, root=root)
    text = "\n".join(r["prompt"] + r["response"] for r in recs)
    assert "Never read" not in text and "caf" not in text  # tests and non-UTF-8 left out
    writes = [r for r in recs if "```python\ndef area" in r["response"]]
    assert len(writes) == 1 and "Return the area of a rectangle." in writes[0]["prompt"]
    assert '"""' not in writes[0]["response"]  # the docstring is the prompt, not the answer
    assert "area(width, height=1)" in writes[0]["prompt"]
    explains = [r for r in recs if r["response"].startswith("Return the area")]
    assert len(explains) == 1 and "return width * height" in explains[0]["prompt"]
    assert any(r["response"] == "Make the square larger by `by`." for r in recs)  # a method
    assert not any("Only a docstring" in r["response"] for r in recs)
    assert any(r["response"] == "A square of one side." and "Square" in r["prompt"]
               for r in recs)  # the class
    assert any(r["response"] == "Shapes and their areas." and "pkg.shapes" in r["prompt"]
               for r in recs)  # the module, by its dotted name
    topics = [r for r in recs if r["prompt"].endswith(("in Python.", "say about assert?"))]
    assert topics and all(len(r["response"]) <= instruct.MAX_CHARS for r in recs)
    assert len(recs) > 60  # the reference topics come from pydoc_data, whatever the root


def test_records_are_the_same_for_a_seed_and_differ_across_seeds(root):
    a, b = instruct.stdlib_records(3, root=root), instruct.stdlib_records(3, root=root)
    assert a == b
    assert instruct.stdlib_records(4, root=root) != a
    assert instruct.stdlib_records(3, limit=5, root=root) == a[:5]
    with pytest.raises(SpecError, match="seed"):
        instruct.stdlib_records(-1, root=root)


def test_records_round_trip_through_a_file(root, tmp_path):
    recs = instruct.stdlib_records(0, limit=20, root=root)
    path = instruct.write_records(recs, tmp_path / "r.jsonl")
    assert instruct.read_records(path) == recs
    assert [set(json.loads(ln)) for ln in path.read_text().splitlines()] == \
        [{"prompt", "response"}] * 20
    with pytest.raises(SpecError, match="exists"):
        instruct.write_records(recs, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib", "r.jsonl"]  # no temporaries


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "a", "response": "b"}\n{"instruction": "a", "output": "b"}\n',
     r"r.jsonl:2 has no string field 'prompt' \(fields: 'instruction', 'output'\)"),
    (b'{"prompt": "a", "response": 3}\n', "r.jsonl:1 has no string field 'response'"),
    (b'{"prompt": "a", "response": "  "}\n', "r.jsonl:1: the response is empty"),
    (b'{"prompt": "caf\xe9", "response": "b"}\n', "r.jsonl: not UTF-8 text"),
    (b'{"prompt": "a", "response": "b"\n', "r.jsonl:1: not valid JSON"),
    (b'["a", "b"]\n', "r.jsonl:1 is not a JSON object"),
    (b"\n\n", "hold no record"),
])
def test_bad_records_are_one_line_naming_the_line(tmp_path, content, needle):
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=needle) as err:
        instruct.read_records(path)
    assert "\n" not in str(err.value)


def test_the_cli_writes_records_and_refuses_bad_input_with_exit_2(root, tmp_path, capsys,
                                                                  monkeypatch):
    made = instruct.stdlib_records
    monkeypatch.setattr(instruct, "stdlib_records",
                        lambda seed, limit: made(seed, limit, root=root))
    out = tmp_path / "r.jsonl"
    assert main(["data", "instruct", "--out", str(out), "--limit", "7", "--seed", "2",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 7 and instruct.read_records(out) == made(2, 7, root=root)
    for argv, needle in ((["--out", str(out)], "exists"),
                         (["--out", str(tmp_path / "no" / "r.jsonl")], "does not exist"),
                         (["--out", str(tmp_path / "x.jsonl"), "--limit", "0"], "must be > 0"),
                         (["--out", str(tmp_path / "x.jsonl"), "--seed", "-1"], "-1")):
        assert main(["data", "instruct", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib", "r.jsonl"]
