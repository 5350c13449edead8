"""The library's architecture, checked: the layers contract (import-linter), every package
in it, no module reaching into another's private names, no module over 400 lines."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib" / "trainplan"
MAX_LINES = 400


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]


def test_import_linter_keeps_every_contract():
    """`lint-imports` over lib/: the layers and no cycle between a package's modules."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib")}
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(_contracts())} kept, 0 broken" in proc.stdout


def test_the_layers_name_every_package_and_top_module():
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    present = {f"trainplan.{p.stem}" for p in LIB.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists())
               or (p.suffix == ".py" and p.name != "__init__.py")}
    assert present == named, (f"in lib, not in the layers: {sorted(present - named)}; "
                              f"in the layers, not in lib: {sorted(named - present)}")


def private_imports(root: Path) -> list[str]:
    """`from trainplan.X import _name` and `alias._name` on an imported trainplan module or
    name, anywhere under `root`, as "path:line: what"."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainplan"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{path}:{node.lineno}: imports {node.module}.{a.name}")
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("trainplan"):
                        names[a.asname or a.name.split(".")[0]] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in names and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{path}:{node.lineno}: uses {names[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_module_s_private_names(tmp_path):
    assert private_imports(LIB) == []
    (tmp_path / "bad.py").write_text("from trainplan.cost import compute\n"
                                     "from trainplan.cost.memory import _sharded\n"
                                     "compute._private(1)\n")
    assert [f.split(": ", 1)[1] for f in private_imports(tmp_path)] == [
        "imports trainplan.cost.memory._sharded", "uses trainplan.cost.compute._private"]


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(LIB)): n for p in LIB.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
