"""Our weights as a Hugging Face Llama folder, and Hugging Face weights back into our model.

`export_checkpoint` reads the model half of a training checkpoint (a DCP
folder committed by its manifest, `bench.ckpt`), `export_state` takes a full
state dict in memory; both write `model.safetensors` and `config.json`, which
`transformers.LlamaForCausalLM.from_pretrained` loads as a model computing
our `Transformer`'s function (`specs.hf.hf_config`; tested to 1e-5 in fp32).
The folder is written under a temporary name beside `out` and renamed into
place, so `out` is either absent or complete. With tied embeddings the table
is written once, as `model.embed_tokens.weight`, as transformers expects.

`load_weights` is the way back: an HF folder (one file or a sharded index)
or a safetensors file into our plain `Transformer`. Only safetensors and
DCP's verified index are read; nothing is unpickled from the weights.
Every mismatch is one `SpecError` line naming the first tensor concerned.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt.dcp_io import (
    CheckpointError,
    dcp_errors,
    one_line,
    one_process,
    tensors_only_planner,
)
from trainplan.bench.harness.model import Transformer
from trainplan.errors import SpecError
from trainplan.loader import load_json, shown
from trainplan.specs import ModelSpec
from trainplan.specs.hf import CONFIG, from_hf_names, hf_config, model_from_hf, to_hf_names

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TIED = "output.weight"  # with tied embeddings, the same tensor as tok_embeddings.weight
NAME_MAX, TMP_EXTRA = 255, 14  # bytes of a file name (Linux); `_write`'s ".NAME.XXXXXXXX.tmp"
ROTARY = "rotary_emb.inv_freq"  # a buffer older transformers saved: not a weight, skipped
# What a config.json must agree on with the model it is loaded into (names, source aside)
_SAME = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "bias",
         "tied_embeddings", "rope_theta", "norm_eps")

# ---------------------------------------------------------------- export


def export_checkpoint(ckpt: Path, spec: ModelSpec, out: Path, *, dtype: str = "float32",
                      max_positions: int) -> Path:
    """Export the model weights of checkpoint `ckpt` as a Hugging Face folder `out`.

    `ckpt`: a `step-N` folder (verified against its manifest), or a run's
    --ckpt-dir (its newest verified checkpoint). The "model" state is loaded by
    `dcp.load` in this one process, which reshards whatever layout saved it
    (DDP, FSDP2 over any number of ranks); the optimizer state is not read.
    `dtype`: of the written weights; `max_positions`: the longest sequence
    (tokens), for config.json. Returns `out`.
    """
    import torch.distributed.checkpoint as dcp

    config = check_export(spec, Path(out), dtype=dtype, max_positions=max_positions)
    path = checkpoint_folder(Path(ckpt))
    saved = _saved_model_tensors(path)
    _check_shapes({k: s for k, (s, _) in saved.items()}, _shapes(spec), spec, str(path),
                  tied_optional=spec.tied_embeddings)
    state = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in saved.items()}
    try:
        with one_process():
            dcp.load({"model": state}, checkpoint_id=str(path), planner=tensors_only_planner(),
                     no_dist=True)
    except dcp_errors() as err:
        raise CheckpointError(f"loading the model state of {path} failed: "
                              f"{one_line(err)}") from None
    return _write(state, spec, config, Path(out), where=str(path))


def export_state(state: dict[str, torch.Tensor], spec: ModelSpec, out: Path, *,
                 dtype: str = "float32", max_positions: int) -> Path:
    """Export a full (unsharded) state dict under our `Transformer`'s names, e.g. its
    `state_dict()`, as a Hugging Face folder `out`; as `export_checkpoint`."""
    config = check_export(spec, Path(out), dtype=dtype, max_positions=max_positions)
    _check_shapes({k: tuple(v.shape) for k, v in state.items()}, _shapes(spec), spec, "state",
                  tied_optional=spec.tied_embeddings)
    return _write(dict(state), spec, config, Path(out), where="state")


def check_export(spec: ModelSpec, out: Path, *, dtype: str, max_positions: int) -> dict:
    """The config.json of an export of `spec` into `out`, after the checks that read no
    checkpoint: the model has a Llama form, `dtype` and `max_positions` are valid, `out` is
    new or an empty folder. One SpecError line; call it before `checkpoint_folder`."""
    config = hf_config(spec, max_positions, dtype=dtype)
    _check_out(out)
    return config


def checkpoint_folder(ckpt: Path, skipped: list | None = None) -> Path:
    """The verified checkpoint `ckpt` names: itself if it is a step folder, else the
    newest verified one in it (a run's --ckpt-dir), the newer step folders that do not
    verify added to `skipped` as (name, why). CheckpointError, one line, if none."""
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: no such checkpoint folder; give a step-N folder or "
                              "a run's --ckpt-dir")
    if mf.step_dirs(ckpt):  # a run's folder: step folders in it
        path, _, passed = mf.newest(ckpt)
        if path is None:
            raise CheckpointError(f"no verified checkpoint in {ckpt} "
                                  f"({mf.skipped_line(passed)})")
        if skipped is not None:
            skipped += passed
        return path
    manifest, why = mf.verify(ckpt)
    if manifest is None:
        raise CheckpointError(f"{ckpt}: not a verified checkpoint ({why})")
    return ckpt


def _saved_model_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Our name -> (shape, dtype) of every tensor under "model" in DCP's index."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        index = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except dcp_errors() as err:
        raise CheckpointError(f"{path}: DCP index unreadable ({one_line(err)})") from None
    return {k[len("model."):]: (tuple(m.size), m.properties.dtype) for k, m in index.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def check_checkpoint_model(path: Path, spec: ModelSpec) -> None:
    """SpecError where the model tensors that DCP's index (`.metadata`) of checkpoint folder
    `path` names are not those of `spec` (names and shapes, as `export_checkpoint` checks
    them). Only the index is read, after `safe_index` allowed it; an index that cannot be
    read is left to the full verification of whoever loads the checkpoint."""
    from trainplan.bench.ckpt import safe_index

    try:
        safe_index.check(path / ".metadata")
        saved = _saved_model_tensors(path)
    except Exception:  # noqa: BLE001 (a damaged index: not this check's to report)
        return
    _check_shapes({k: s for k, (s, _) in saved.items()}, _shapes(spec), spec, str(path),
                  tied_optional=spec.tied_embeddings)


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of our `Transformer` of `spec` (built on meta: free)."""
    with torch.device("meta"):
        model = Transformer(spec, max_seq_len=1)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_shapes(got: dict, want: dict, spec: ModelSpec, where: str, *,
                  tied_optional: bool, name=repr) -> None:
    """SpecError naming the first tensor missing, of another shape, or not in `spec`."""
    for key, shape in want.items():
        if key not in got and not (tied_optional and key == TIED):
            raise SpecError(f"{where}: no tensor {name(key)}; it holds another model than "
                            f"{spec.name!r} (a Llama of {spec.n_layers} layers)")
        if key in got and tuple(got[key]) != shape:
            raise SpecError(f"{where}: tensor {name(key)} is {list(got[key])}, but model "
                            f"{spec.name!r} has {list(shape)}; it holds another model")
    extra = [k for k in got if k not in want]
    if extra:
        raise SpecError(f"{where}: tensor {name(extra[0])} is not in model {spec.name!r} "
                        f"({len(extra)} such); it holds another model")


def _check_out(out: Path) -> None:
    """SpecError, one line, unless `out` is new or an empty folder, the nearest folder above
    it that exists (where `_write` makes its temporary folder) is one this user can write in,
    and the temporary folder's name fits in NAME_MAX bytes."""
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SpecError(f"{out}: exists and is not an empty folder; export into a new or "
                            "empty folder")
        above = next(p for p in out.absolute().parents if p.exists())
        if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
            raise SpecError(f"{shown(out)}: {shown(above)} is not a folder this user can write "
                            "in; export into a new or empty folder")
    except OSError as err:  # ENAMETOOLONG, EACCES: the path cannot even be looked at
        raise SpecError(f"{shown(out)}: {err.strerror or one_line(err)}; export into a new or "
                        "empty folder") from None
    if len(os.fsencode(out.name)) > NAME_MAX - TMP_EXTRA:
        raise SpecError(f"{shown(out)}: the name is {len(os.fsencode(out.name))} bytes, too "
                        f"long for the temporary folder beside it; at most "
                        f"{NAME_MAX - TMP_EXTRA} bytes")


def _write(state: dict, spec: ModelSpec, config: dict, out: Path, *, where: str) -> Path:
    """safetensors + config.json into a temporary folder beside `out`, renamed into place."""
    from safetensors.torch import save_file

    if spec.tied_embeddings and TIED in state:
        if not torch.equal(state[TIED], state["tok_embeddings.weight"]):
            raise SpecError(f"{where}: output.weight differs from tok_embeddings.weight, so "
                            f"it was not trained tied; export with tied_embeddings false")
        del state[TIED]
    dt, seen, tensors = DTYPES[config["dtype"]], set(), {}
    for key, value in to_hf_names(state).items():
        t = value.detach().to("cpu", dt).contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as err:  # what _check_out cannot see (root in /proc, a full disk)
        raise SpecError(f"{shown(out)}: cannot be made ({err.strerror or one_line(err)}); "
                        "export into a new or empty folder") from None
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the model from the rest of the team
        try:
            os.replace(tmp, out)  # over an empty folder too (POSIX rename)
        except OSError as err:  # filled (or made a file) since _check_out looked
            raise SpecError(f"{out}: cannot be replaced ({err.strerror}); export into a new "
                            "or empty folder") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- import


def load_weights(model: nn.Module, path) -> None:
    """Copy Hugging Face Llama weights into our plain `Transformer` `model`, in place.

    `path`: a safetensors file, or an HF folder holding `model.safetensors` or a
    sharded `model.safetensors.index.json`. Names go through `specs.hf.from_hf_names`;
    a missing, extra or misshapen tensor, or a config.json in the folder that
    disagrees with `model.spec`, is one SpecError line. Values are cast to the
    model's dtypes. With tied embeddings, a `lm_head.weight` in the file must
    equal the table.
    """
    path = Path(path)
    ours = model.state_dict()
    tied = ours[TIED].data_ptr() == ours["tok_embeddings.weight"].data_ptr()
    source = _sources(path, model.spec, {k: tuple(v.shape) for k, v in ours.items()}, tied)
    head = None
    with torch.no_grad():
        for file in dict.fromkeys(f for f, _ in source.values()):
            with _open(file) as f:
                for key, (src, hf) in source.items():
                    if src != file:
                        continue
                    if tied and key == TIED:  # the table is loaded once, as the embedding
                        head = f.get_tensor(hf)
                    else:
                        ours[key].copy_(f.get_tensor(hf))
    if head is not None and not torch.equal(head.to(ours[TIED].dtype), ours[TIED]):
        raise SpecError(f"{path}: lm_head.weight differs from model.embed_tokens.weight, but "
                        f"model {model.spec.name!r} has tied embeddings; load into an untied "
                        "model")


def check_weights(spec: ModelSpec, path) -> None:
    """`load_weights`' checks of the weights at `path` for a model of `spec`, from the
    safetensors headers and config.json only (no tensor is read): one SpecError line."""
    _sources(Path(path), spec, _shapes(spec), spec.tied_embeddings)


def _sources(path: Path, spec: ModelSpec, want: dict, tied: bool) -> dict:
    """Our name -> (safetensors file, HF name) of every tensor at `path` (`load_weights`'),
    checked against `want` (our name -> shape) and a config.json beside them."""
    files = _weight_files(path)
    if path.is_dir() and (path / CONFIG).is_file():
        _check_config(model_from_hf(path), spec, path / CONFIG)
    shapes, source = {}, {}  # our name -> shape in the file; -> (file, HF name)
    for file, names in files.items():
        held = _shapes_in(file)
        names = [k for k in names if not k.endswith(ROTARY)] if names is not None else None
        missing = sorted(set(names or ()) - set(held))
        if missing:
            raise SpecError(f"{file}: no tensor {missing[0]!r}, which {INDEX} puts here")
        try:
            renamed = from_hf_names({k: k for k in (names or held)})
        except SpecError as err:
            raise SpecError(f"{file}: {err}") from None
        for key, hf in renamed.items():
            shapes[key], source[key] = held[hf], (file, hf)
    _check_shapes(shapes, want, spec, str(path), tied_optional=tied, name=_both_names)
    return source


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors' SafetensorError: not a safetensors file
        raise SpecError(f"{file}: not a readable safetensors file ({one_line(err)})") from None


def _shapes_in(file: Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in a safetensors file (its header only); the
    rotary tables older transformers saved are not weights and are left out."""
    with _open(file) as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                if not k.endswith(ROTARY)}


def _both_names(key: str) -> str:
    try:
        return f"{next(iter(to_hf_names({key: None})))!r} (ours {key!r})"
    except SpecError:
        return repr(key)


def _check_config(theirs: ModelSpec, ours: ModelSpec, file: Path) -> None:
    for field in _SAME:
        if getattr(theirs, field) != getattr(ours, field):
            raise SpecError(f"{file}: {field} = {getattr(theirs, field)!r} there, but the model "
                            f"{ours.name!r} has {getattr(ours, field)!r}; load into a model "
                            "of that config")


def _weight_files(path: Path) -> dict[Path, list[str] | None]:
    """safetensors file -> the HF names the index puts in it (None: all it holds). One
    SpecError line where `path` is no HF folder or safetensors file, or cannot be looked
    at (a name longer than the system allows, a folder not ours to read)."""
    try:
        if path.is_file():
            return {path: None}
        if not path.is_dir():
            raise SpecError(f"{shown(path)}: no such file or folder; give an HF model folder "
                            "or a .safetensors file")
        if (path / WEIGHTS).is_file():
            return {path / WEIGHTS: None}
        if not (path / INDEX).is_file():
            raise SpecError(f"{shown(path)}: neither {WEIGHTS} nor {INDEX} in it; pickled "
                            "weights (pytorch_model.bin) are not read")
        try:
            weight_map = load_json(path / INDEX, what=INDEX)["weight_map"]
            files: dict[Path, list[str]] = {}
            for name, file in weight_map.items():
                if (not isinstance(file, str) or Path(file).name != file
                        or not isinstance(name, str)):
                    raise ValueError(f"entry {name!r}: {file!r} is not a file name in the folder")
                files.setdefault(path / file, []).append(name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise SpecError(f"{path / INDEX}: not a valid index ({one_line(err)})") from None
        for file in files:
            if not file.is_file():
                raise SpecError(f"{path / INDEX}: names {file.name}, which is not in {path}")
    except OSError as err:  # ENAMETOOLONG, EACCES: the path cannot even be looked at
        raise SpecError(f"{shown(err.filename or path)}: {err.strerror or one_line(err)}; give "
                        "an HF model folder or a .safetensors file you can read") from None
    return files


def load_into_parts(parts: list[nn.Module], spec: ModelSpec, path) -> None:
    """Hugging Face weights (`load_weights`'s `path`) into a parallelised model's parts.

    Every rank reads the whole model into a plain CPU copy first (`load_weights`, its
    checks), then each part takes its own tensors through
    `torch.distributed.checkpoint.state_dict.set_model_state_dict` with full tensors,
    which shards them as the part is laid out (FSDP2, TP, both) and leaves a pipeline
    stage's absent blocks aside. Host memory: one full fp32 copy per rank while loading.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    plain = Transformer.from_spec(spec, max_seq_len=1)
    load_weights(plain, path)
    full = plain.state_dict()
    options = StateDictOptions(full_state_dict=True, strict=False)
    for part in parts:
        wanted = [k for k in part.state_dict() if k in full]
        set_model_state_dict(part, {k: full[k] for k in wanted}, options=options)
