"""DCP's checkpoint index (`.metadata`) is a pickle: read it first with only DCP's types allowed.

`torch.distributed.checkpoint.FileSystemReader.read_metadata` unpickles `.metadata` with
`pickle.load`, which calls whatever a crafted file names. The manifest's sha256 says only that
a folder is as its writer sealed it, and anyone can reseal one. `check` unpickles the file
with a whitelist of what DCP writes there (the classes of its metadata and filesystem
modules, torch.Size, dtypes, layouts, paths) and refuses anything else, so that DCP reads
only an index that names nothing more.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path

import torch

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
EXACT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
         ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
         ("collections", "OrderedDict")}
MAX_BYTES = 1 << 30  # an index is kilobytes to megabytes; a larger file is not one


class Refused(Exception):
    """`.metadata` names something other than DCP's own types (the name in args[0])."""


class _DcpOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name:  # a dotted name would reach through a module to anything
            if module in DCP_MODULES:
                obj = getattr(importlib.import_module(module), name, None)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if (module, name) in EXACT:
                return super().find_class(module, name)
        raise Refused(f"{module}.{name}")


def check(path: Path) -> None:
    """Unpickle `path` allowing DCP's metadata types only: Refused (naming what it asked
    for) if it names anything else, the unpickler's own errors if it is malformed."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise Refused(f"a {size:,}-byte file")
    _DcpOnly(io.BytesIO(path.read_bytes())).load()
