"""Instruction records, {"prompt": ..., "response": ...}: made from the Python stdlib, or read.

The job a fine-tuning recipe is for trains on prompt/response pairs whose lengths vary by
orders of magnitude. Nothing can be downloaded here, so a stand-in of that shape is made
from text every machine with Python has (`stdlib_records`): the standard library's source
(`corpus.stdlib_files`) and its language-reference topics (`pydoc_data.topics`). Kinds:

    write    docstring of a function or method -> its code (docstring taken out)
    explain  the code of a function or method -> its docstring
    class    a class's name, module and method names -> the class docstring
    module   a module's name -> its docstring
    topic    a reference topic's name -> its text

Candidates are collected in sorted file order, shuffled by `seed` (numpy PCG64), and each
takes one of its kind's phrasings by the same generator: the same seed and Python version
give the same records. Texts over `MAX_CHARS` are left out (truncation to the sequence
length happens at tokenisation, `data.rows`).

`read_records` reads a team's file (JSON lines; other keys are ignored); bad input is one
`SpecError` line naming the file and line. `write_records` writes a new file whole or not
at all (`trainplan data instruct`).
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import textwrap
from pathlib import Path

import numpy as np

from trainplan import loader
from trainplan.data import corpus
from trainplan.errors import SpecError

FIELDS = ("prompt", "response")
MAX_CHARS = 20_000  # a text longer than this is left out (the longest topics are ~50,000)
PHRASES = {
    "write": ("Write a Python {what} `{sig}` that does the following.\n\n{doc}",
              "Implement `{sig}` in Python. Its documentation says:\n\n{doc}",
              "Here is the specification of a {what} `{sig}`:\n\n{doc}\n\nWrite the code."),
    "explain": ("Explain what this {what} from the `{module}` module does.\n\n"
                "```python\n{code}\n```",
                "What does the following code do?\n\n```python\n{code}\n```",
                "Write the docstring for this {what}.\n\n```python\n{code}\n```"),
    "class": ("Describe the class `{name}` of the Python module `{module}`.",
              "What is `{module}.{name}` for? Its methods are: {methods}."),
    "module": ("What is the Python module `{module}` for?",
               "Summarise the documentation of the `{module}` module."),
    "topic": ("Explain {name} in Python.",
              "What does the Python language reference say about {name}?"),
}


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or path.stem


def _code(node, lines: list[str]) -> str | None:
    """A function's source without its docstring, dedented; None where nothing is left."""
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    doc = node.body[0]
    if doc.lineno <= node.lineno or len(node.body) < 2:  # one-line def, or docstring only
        return None
    kept = lines[first - 1:doc.lineno - 1] + lines[doc.end_lineno:node.end_lineno]
    return textwrap.dedent("\n".join(kept)).strip("\n")


def _candidates(path: Path, root: Path) -> list[tuple[str, dict]]:
    """(kind, fields) of every documented module, class, function and method of one file."""
    try:
        src = path.read_text("utf-8")
        tree = ast.parse(src)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return []  # a file of another encoding or grammar: left out, as in the corpus
    module, lines, out = _module(path, root), src.splitlines(), []
    if doc := ast.get_docstring(tree):
        out.append(("module", {"module": module, "doc": doc}))

    def function(node, owner: str | None) -> None:
        doc, code = ast.get_docstring(node), None
        if doc and (code := _code(node, lines)):
            name = f"{owner}.{node.name}" if owner else node.name
            fields = {"module": module, "doc": doc, "code": code,
                      "what": "method" if owner else "function",
                      "sig": f"{name}({ast.unparse(node.args)})"}
            out.extend([("write", fields), ("explain", fields)])

    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, funcs):
            function(node, None)
        elif isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, funcs)]
            if doc := ast.get_docstring(node):
                names = ", ".join(m.name for m in methods) or "none"
                out.append(("class", {"module": module, "name": node.name, "doc": doc,
                                      "methods": names}))
            for m in methods:
                function(m, node.name)
    return out


def _record(kind: str, fields: dict, phrase: str) -> dict:
    response = f"```python\n{fields['code']}\n```" if kind == "write" else fields["doc"]
    return {"prompt": phrase.format(**fields), "response": response}


def stdlib_records(seed: int = 0, limit: int | None = None,
                   root: str | Path | None = None) -> list[dict]:
    """Prompt/response records from the stdlib (or the .py files under `root`) and the
    reference topics, shuffled by `seed`; the first `limit` of them if given."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SpecError(f"seed = {seed!r} is not valid; use a whole number >= 0")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    cands = []
    for path in corpus.stdlib_files(base):
        cands += _candidates(path, base)
    from pydoc_data.topics import topics  # the language reference's topics, shipped with Python

    cands += [("topic", {"name": name.replace("-", " "), "doc": text.strip()})
              for name, text in sorted(topics.items())]
    rng = np.random.Generator(np.random.PCG64(seed))
    out = []
    for i in rng.permutation(len(cands)):
        kind, fields = cands[i]
        phrases = PHRASES[kind]
        rec = _record(kind, fields, phrases[int(rng.integers(len(phrases)))])
        if rec["response"].strip() and max(map(len, rec.values())) <= MAX_CHARS:
            out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    return out


def check_record(obj, where: str) -> dict:
    """`obj` as a record {"prompt": str, "response": non-empty str}; else one line."""
    if not isinstance(obj, dict):
        raise SpecError(f"{where} is not a JSON object; each line must be "
                        '{"prompt": "...", "response": "..."}')
    for field in FIELDS:
        if not isinstance(obj.get(field), str):
            have = ", ".join(map(repr, list(obj)[:6])) or "none"
            raise SpecError(f"{where} has no string field {field!r} (fields: {have}); each "
                            'line must be {"prompt": "...", "response": "..."}')
    if not obj["response"].strip():
        raise SpecError(f"{where}: the response is empty (nothing to train on)")
    return {"prompt": obj["prompt"], "response": obj["response"]}


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file, in order (blank lines skipped); at least one. Read
    through the project's one loader (`trainplan.loader.json_lines`: size, UTF-8 and value
    caps), each record then checked (`check_record`)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"instruction records {str(path)!r}: no such file")
    out = [check_record(obj, f"{path}:{n}")
           for n, obj in loader.json_lines(path, what="file of instruction records")]
    if not out:
        raise SpecError(f"instruction records {str(path)!r} hold no record")
    return out


def check_out(path: str | Path) -> Path:
    """`path` as a new file in a folder that exists; else one line."""
    path = Path(path)
    if path.exists():
        raise SpecError(f"--out {str(path)!r} exists; name a new file")
    if not path.parent.is_dir():
        raise SpecError(f"--out {str(path)!r}: folder {str(path.parent)!r} does not exist")
    return path


def write_records(records: list[dict], path: str | Path) -> Path:
    """Write `records` as JSON lines to the new file `path`: under a temporary name, renamed
    when whole, so a stopped run leaves nothing; refuses a file that exists."""
    path = check_out(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps({k: rec[k] for k in FIELDS}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
