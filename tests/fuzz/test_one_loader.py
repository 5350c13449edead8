"""Every YAML and JSON file the library reads goes through `trainplan.loader`, and the
loader's bounds hold: no other parser call in lib/ but the few listed with their reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainplan import loader
from trainplan.errors import SpecError

LIB = Path(__file__).resolve().parents[2] / "lib" / "trainplan"
PARSE = re.compile(r"\b(yaml\.(safe_)?load(_all)?|yaml\.(C|Full|Unsafe)?Loader|json\.loads?)\(")
# path under lib/trainplan -> why its own parsing is right there
NOT_USER_FILES = {
    "loader.py": "the loader itself",
    "runbook/build.py": "the repository's own notebooks (outputs with images past the caps)",
    "runbook/site.py": "a built notebook of the runbook's own (outputs past the caps)",
    "data/corpus.py": "a training corpus streamed line by line: data of any size, not a spec",
    "tune/trial.py": "the summary line a child harness process printed",
    "bench/series/suite.py": "the summary line a child harness process printed",
    "bench/series/suite_sweep.py": "the summary lines a child harness process printed",
    "commands/benchmarking.py": "the summary line a child harness process printed",
    "commands/training.py": "the summary line a child trainer process printed",
    "bench/series/sweep.py": "the run list its parent process wrote for it",
    "bench/harness/data.py": "the harness's own token cache, written beside it",
    "bench/harness/monitor.py": "the metrics log the monitor itself wrote",
    "bench/ckpt/manifest.py": "checkpoint manifests: size-capped, unique keys, sealed by their "
                              "own checksum (bench.ckpt verifies them)",
    "bench/ckpt/report.py": "the checkpoint benchmark's own result lines",
}


def parser_calls() -> dict[str, list[str]]:
    """lib/trainplan file -> the YAML or JSON parser calls in it (not comments)."""
    found = {}
    for path in sorted(LIB.rglob("*.py")):
        hits = [line.strip() for line in path.read_text().splitlines()
                if PARSE.search(line.split("#")[0])]
        if hits:
            found[str(path.relative_to(LIB))] = hits
    return found


def test_no_yaml_or_json_parsing_outside_the_loader_but_the_listed():
    calls = parser_calls()
    assert sorted(set(calls) - set(NOT_USER_FILES)) == [], calls
    assert "specs/__init__.py" not in calls and "loader.py" in calls  # the grep sees calls


def test_the_grep_would_catch_a_new_parser_call(tmp_path, monkeypatch):
    (tmp_path / "sneaky.py").write_text("import yaml\nspec = yaml.safe_load(open('m.yaml'))\n")
    monkeypatch.setitem(globals(), "LIB", tmp_path)
    assert parser_calls() == {"sneaky.py": ["spec = yaml.safe_load(open('m.yaml'))"]}


@pytest.mark.parametrize("text, fragment", [
    ("a: &x [1]\nb: *x\n", "alias"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", "nested more than"),
    ("a: " + "1" * 41 + "\n", "a number of 41 characters"),
    ("a: " + "x" * (loader.MAX_STRING + 1) + "\n", "characters; at most"),
    ("a: 1\na: 2\n", "key 'a' given twice"),
    ("a: !!python/object:os.system 1\n", "not valid YAML"),
])
def test_yaml_bounds(text, fragment):
    with pytest.raises(SpecError, match=fragment) as err:
        loader.parse_yaml(text, "f.yaml")
    assert len(str(err.value)) < 200


@pytest.mark.parametrize("text, fragment", [
    ('{"a": 1, "a": 2}', "given twice"), ("1" * 41, "41 digits"), ("1e999", "finite"),
    ("NaN", "finite"), ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('["' + "x" * (loader.MAX_STRING + 1) + '"]', "a string of more than"),
])
def test_json_bounds(text, fragment):
    with pytest.raises(SpecError, match=fragment):
        loader.parse_json(text, "f.json")
    assert loader.parse_json("[NaN]", "j", constants=True)[0] != 0  # Optuna's journals


def test_read_text_checks_size_kind_and_encoding(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a" * (loader.MAX_SPEC_BYTES + 1))
    for path, fragment in ((big, "too large"), ("/dev/zero", "not a regular file"),
                           (tmp_path, "is a folder"), (tmp_path / "no.yaml", "no such file")):
        with pytest.raises(SpecError, match=fragment):
            loader.read_text(path)
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert loader.load_yaml(tmp_path / "bom.yaml") == {"a": 1}
    (tmp_path / "latin.yaml").write_bytes("a: caf\xe9\n".encode("latin-1"))
    with pytest.raises(SpecError, match=r"not UTF-8 text \(byte 0xe9 at offset 6\)"):
        loader.load_yaml(tmp_path / "latin.yaml")


def test_quote_is_short_whatever_the_value():
    for value in ("x" * 10**6, 10**5000, [[[[[1]]]]] * 1000, {str(i): i for i in range(10**4)}):
        assert len(loader.quote(value)) <= loader.QUOTE
