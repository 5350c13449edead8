"""Validated specs: model, GPU, cluster, parallel layout, scenario.

Plain frozen dataclasses rather than pydantic: the GPU machines that run the
proxy harness have no pydantic, and the harness records predictions through
this same code. Each spec checks its own fields in `__post_init__` and raises
`SpecError` naming the field, the bad value and what is valid.

Presets are YAML files under data/ (models/, hardware/, clusters/,
scenarios/); anywhere a preset name is accepted, a path to a YAML file works
too, and for a model a Hugging Face Llama `config.json` or its folder
(`specs.hf`). Every file is read through `trainplan.loader` (bounded, no aliases).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainplan.errors import PresetNotFound, SpecError
from trainplan.loader import load_yaml, quote, shown
from trainplan.specs.bounds import MAX_NAME
from trainplan.specs.checks import (  # noqa: F401 (MAX_INT: re-exported)
    MAX_INT,
    check_fields,
    yaml11_float,
)
from trainplan.specs.model import ModelSpec  # its own module, so specs.hf can build one

DATA_DIR = Path(os.environ.get("TRAINPLAN_DATA", Path(__file__).resolve().parents[3] / "data"))
SUITE_CLUSTER = "dgx-h100"  # the interconnect preset the measurement suites run under
# A layout's fields: those every record's `layout` carries, then those a plan also pins (the
# order of `trainplan plan --json`'s "parallel").
LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "recompute")
PLAN_FIELDS = LAYOUT_FIELDS + ("dp_shard", "pp_schedule", "pp_virtual", "sequence_parallel")
SLICE = re.compile(r"(?P<base>.+):(?P<layers>\d+)-layers")  # NAME:N-layers, its first N blocks

GiB = 1024**3


def from_mapping(cls, mapping, source: str):
    """Build spec `cls` from a YAML mapping; unknown or missing keys are errors."""
    if not isinstance(mapping, dict):
        raise SpecError(f"{source}: expected a mapping of {cls.__name__} fields, got "
                        f"{quote(mapping)}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    unknown = sorted(set(mapping) - names, key=str)
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), names, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SpecError(f"{source}: unknown field {quote(unknown[0])}; {hint}valid fields: "
                        f"{quote(sorted(names), 200)}")
    missing = sorted(required - set(mapping))
    if missing:
        raise SpecError(f"{source}: missing field {missing[0]!r} (required: {sorted(required)})")
    hints = typing.get_type_hints(cls)
    mapping = {k: yaml11_float(v) if hints[k] is float else v for k, v in mapping.items()}
    try:
        return cls(**mapping)
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None


# ---------------------------------------------------------------- hardware


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: datasheet peaks plus the fractions of them that real kernels reach.

    Every number is checked against `specs.bounds.FIELDS`, every row of a measured table
    column by column against `specs.bounds.TABLES` or `CURVES` (`specs.checks.check_fields`).
    """

    name: str
    bf16_tflops: float  # dense bf16 peak, TFLOP/s (MFU is quoted against this)
    memory_gib: float  # memory the framework sees (GiB)
    hbm_tbps: float  # HBM bandwidth, TB/s
    matmul_efficiency: float  # achieved fraction of bf16 peak on large GEMMs
    attention_efficiency: float  # achieved fraction of peak in fused attention (fwd + bwd)
    memory_efficiency: float  # achieved fraction of HBM bandwidth on streaming kernels
    fp8_tflops: float = 0.0  # dense fp8 (e4m3) peak, TFLOP/s; 0 = no fp8 matmuls (A100)
    fp8_matmul_efficiency: float = 0.0  # stated fraction of fp8 peak until measured; 0 = none
    fp8_matmul_curve: tuple = ()  # ((tokens, n k, fraction of fp8 peak), ...) tensorwise scaling
    fp8_rowwise_matmul_curve: tuple = ()  # the same with a scale per row (torchao rowwise)
    fp8_cast_scale: float = 1.0  # torchao tensorwise casts' time / analytic bytes at HBM rate
    fp8_rowwise_cast_scale: float = 1.0  # the same for rowwise casts; 1 = not measured
    fp8_activation_ratio: float = 1.0  # a compiled fp8 block's kept bytes / bf16's, tensorwise
    fp8_rowwise_activation_ratio: float = 1.0  # the same for rowwise; 1 = not measured
    source: str = ""
    cluster: str = ""  # the interconnect preset this card comes in (--cluster's default); "" none
    calibration: str = "datasheet"  # where the efficiencies come from (calibrate.py sets it)
    collectives: tuple = ()  # measured (op, latency_us, busbw_gbps) inside a node; () = cluster's
    # Scales on the analytic terms, measured on the model's own pieces (calibrate_pieces.py);
    # 1 (and 0 exposed) = the analytic model as written, uncalibrated.
    elementwise_scale: float = 1.0  # compiled blocks' element-wise time / analytic bytes
    eager_elementwise_scale: float = 1.0  # the same for eager (unfused) blocks
    head_scale: float = 1.0  # output layer + loss time / analytic
    optimizer_scale: float = 1.0  # clip + fused AdamW time / analytic 32 B per param
    overlap_exposed: float = 0.0  # fraction of overlapped collective time that still shows
    logits_scale: float = 1.0  # output layer + loss peak bytes / analytic 10 B per logit
    activation_scales: tuple = ()  # (compiled, recompute, measured / analytic bytes kept)
    # Layouts that keep fp32 weights under autocast (no FSDP2 mixed precision) and their
    # pieces; 0 = not measured, the bf16 scale above stands in.
    autocast_elementwise_scale: float = 0.0  # compiled blocks, fp32 weights under autocast
    eager_autocast_elementwise_scale: float = 0.0  # eager blocks, fp32 weights under autocast
    compiled_head_scale: float = 0.0  # output layer + compiled loss time / analytic
    ddp_block_scale: float = 1.0  # DDP-wrapped compiled block time, less bucket copies / alone
    fsdp_block_scale: float = 1.0  # FSDP2-wrapped block, less copies and collectives / alone
    tp_block_scales: tuple = ()  # ((tp, with FSDP2 0|1, TP block less priced comm / compute),)
    matmul_curve: tuple = ()  # ((tokens, n k, fraction of peak), ...) block GEMMs; () = one
    head_matmul_curve: tuple = ()  # the same for the output layer alone; () = matmul_curve's
    attention_curve: tuple = ()  # ((seq, dense-equivalent fraction of peak), ...); () = one
    host_block_s: tuple = ()  # ((wrapper, host s per block), ...) (calibrate_host); () = no floor
    host_step_s: tuple = ()  # ((wrapper, host s a step outside the blocks), ...); () = none
    host_step_layer_s: tuple = ()  # ((wrapper, host s a layer outside its block), ...); () = none
    host_overlap_k: float = 0.0  # host/GPU interleave exponent (calibrate_host); 0 = max()
    ring_host_s: tuple = ()  # ((cp, compiled 0|1, host s a block's ring beyond SDPA), ...)
    # ((wrapper, compute-stream reserve per layer / kept bytes), ...) (calibrate_memory);
    # () = memory_runtime.FRAGMENTATION for every layout
    fragmentation_scales: tuple = ()

    def __post_init__(self):
        check_fields(self, positive=("bf16_tflops", "memory_gib", "hbm_tbps", "matmul_efficiency",
                                  "attention_efficiency", "memory_efficiency",
                                  "elementwise_scale", "eager_elementwise_scale", "head_scale",
                                  "optimizer_scale", "logits_scale", "ddp_block_scale",
                                  "fsdp_block_scale", "fp8_cast_scale", "fp8_rowwise_cast_scale",
                                  "fp8_activation_ratio", "fp8_rowwise_activation_ratio"),
                  non_negative=("fp8_tflops", "fp8_matmul_efficiency", "overlap_exposed",
                                "autocast_elementwise_scale", "eager_autocast_elementwise_scale",
                                "compiled_head_scale", "host_overlap_k"))


@dataclass(frozen=True)
class ClusterSpec:
    """The interconnect: GPUs per node, NVLink inside a node, InfiniBand across nodes.

    Bandwidths are per GPU, one direction, GB/s; latencies are per ring step, us.
    """

    name: str
    gpus_per_node: int
    intra_node_gbps: float  # NVLink per GPU per direction (H100: 900 both ways -> 450)
    inter_node_gbps: float  # network per GPU per direction (8 x 400 Gb/s per node -> 50)
    intra_node_latency_us: float
    inter_node_latency_us: float
    intra_node_efficiency: float  # achieved bus bandwidth / link bandwidth on large messages
    inter_node_efficiency: float
    source: str = ""
    collectives: tuple = ()  # (op, latency_us, busbw_gbps) measured inside a node, per op

    def __post_init__(self):
        check_fields(self, positive=("gpus_per_node", "intra_node_gbps", "inter_node_gbps",
                                  "intra_node_efficiency", "inter_node_efficiency"),
                  non_negative=("intra_node_latency_us", "inter_node_latency_us"))


# ---------------------------------------------------------------- layout

Recompute = Literal["none", "selective", "full"]
PPSchedule = Literal["1f1b", "interleaved", "gpipe"]


@dataclass(frozen=True)
class ParallelConfig:
    """One parallel layout. World size = dp * tp * pp * cp.

    Expert parallel borrows ranks from data (and context) parallel, as in
    Megatron-Core and torchtitan: `ep` divides dp * cp and adds no GPUs.
    """

    dp: int = 1  # data-parallel replicas (or shards, with zero >= 1)
    tp: int = 1  # tensor parallel (Megatron-style, inside a node)
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel (sequence split across ranks, ring attention)
    ep: int = 1  # expert parallel (MoE only)
    zero: int = 0  # 0 = DDP; 1 optimizer, 2 + grads, 3 + weights sharded (3 = FSDP)
    dp_shard: int = 0  # ranks one ZeRO shard spans; 0 means all of dp; < dp is HSDP
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step (= pipeline micro-batches)
    recompute: Recompute = "none"
    sequence_parallel: bool = True  # shard norms/residual along the sequence when tp > 1
    pp_schedule: PPSchedule = "1f1b"
    pp_virtual: int = 1  # virtual stages per rank (interleaved schedule)

    def __post_init__(self):
        if self.dp_shard == 0:
            object.__setattr__(self, "dp_shard", self.dp if self.zero else 1)
        check_fields(self, positive=("dp", "tp", "pp", "cp", "ep", "dp_shard", "micro_batch",
                                  "grad_accum", "pp_virtual"))
        if self.zero not in (0, 1, 2, 3):
            raise SpecError(f"ParallelConfig.zero = {self.zero!r} is not valid; use 0, 1, 2 or 3")
        if self.dp % self.dp_shard:
            raise SpecError(
                f"ParallelConfig.dp_shard = {self.dp_shard} must divide dp = {self.dp}"
            )
        if self.zero == 0 and self.dp_shard != 1:
            raise SpecError("ParallelConfig.dp_shard > 1 needs zero >= 1 (DDP shards nothing)")
        if (self.dp * self.cp) % self.ep:
            raise SpecError(
                f"ParallelConfig.ep = {self.ep} must divide dp * cp = {self.dp * self.cp}"
            )
        if self.pp_schedule != "interleaved" and self.pp_virtual != 1:
            raise SpecError("ParallelConfig.pp_virtual > 1 needs pp_schedule 'interleaved'")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


# ---------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Scenario:
    """What the runbook is about: a model on a cluster for a token budget."""

    model: str  # preset name or YAML path
    gpu: str
    cluster: str
    gpus: int
    seq_len: int
    global_batch_tokens: int
    token_budget: float  # tokens to train on
    title: str = ""

    def __post_init__(self):
        check_fields(self, positive=("gpus", "seq_len", "global_batch_tokens", "token_budget"))


# ---------------------------------------------------------------- presets

_KINDS = {ModelSpec: "models", GPUSpec: "hardware", ClusterSpec: "clusters", Scenario: "scenarios"}


def preset_names(cls) -> list[str]:
    """Names of the presets of one kind found under data/."""
    folder = DATA_DIR / _KINDS[cls]
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _is_name(name_or_path) -> bool:
    """Whether a spec argument is a preset's name (else a file's path)."""
    return not (Path(name_or_path).suffix in (".yaml", ".yml") or os.sep in str(name_or_path))


def preset_of(cls, name_or_path: str) -> str | None:
    """The preset `name_or_path` is (its name, or the path of its file under data/), or None
    for any other file, whatever that file is called."""
    folder = DATA_DIR / _KINDS[cls]
    path = folder / f"{name_or_path}.yaml" if _is_name(name_or_path) else Path(name_or_path)
    try:
        same = path.resolve().parent == folder.resolve() and path.is_file()
    except (OSError, ValueError, RuntimeError):
        return None
    return path.stem if same else None


def _file_type(path: Path, given) -> str | None:
    """"file", "dir", "other" or None (nothing there); a name the OS will not look up
    (too long, a NUL byte) is a `PresetNotFound` naming what was given."""
    try:
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
        return "other" if path.exists() else None
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not a valid name"
        raise PresetNotFound(f"{quote(str(given))}: {reason.lower()}; use a preset name or "
                             "the path of a .yaml file") from None


def load(cls, name_or_path: str):
    """Load a preset by name, or a YAML file by path, as spec `cls`."""
    kind = _KINDS[cls]
    path = Path(name_or_path)
    if _is_name(name_or_path):
        path = DATA_DIR / kind / f"{name_or_path}.yaml"
        if _file_type(path, name_or_path) != "file":
            raise PresetNotFound(
                f"unknown {kind[:-1] if kind != 'hardware' else 'gpu'} {quote(name_or_path)}; "
                f"presets: {preset_names(cls)} (or a path to a .yaml file)"
            )
    found = _file_type(path, name_or_path)
    if found == "dir":
        raise PresetNotFound(f"{quote(str(name_or_path))} is a directory, not a YAML file")
    if found is None:
        raise PresetNotFound(f"no such file {quote(str(name_or_path))}")
    mapping = load_yaml(path, what=f"{kind[:-1] if kind != 'hardware' else 'gpu'} YAML file")
    if isinstance(mapping, dict) and "name" in cls.__dataclass_fields__:
        mapping.setdefault("name", path.stem[:MAX_NAME])
    return from_mapping(cls, mapping, shown(path))


def load_model(name: str) -> ModelSpec:
    """A model preset, YAML file, or Hugging Face Llama `config.json` (the file or its
    folder); `NAME:N-layers` is its first N blocks (a layer slice).

    A slice keeps the real width, so a few layers of a large model can be
    measured on a few GPUs and set beside the planner's price for them.
    """
    sliced = SLICE.fullmatch(str(name))
    if not sliced:
        return _load_model(name)
    spec, n = _load_model(sliced["base"]), int(sliced["layers"])
    if not 1 <= n <= spec.n_layers:
        raise SpecError(f"model {quote(name)}: {quote(spec.name)} has {spec.n_layers} layers; "
                        f"slice 1..{spec.n_layers} of them")
    return dataclasses.replace(spec, n_layers=n, name=str(name))


def _load_model(name) -> ModelSpec:
    """A preset name wins over a folder of that name; a .json file or a folder is read as
    a Hugging Face config (`specs.hf.model_from_hf`), anything else as preset or YAML."""
    path = Path(name)
    preset = (os.sep not in str(name)
              and _file_type(DATA_DIR / "models" / f"{name}.yaml", name) == "file")
    if not preset and (_file_type(path, name) == "dir" or path.suffix == ".json"):
        from trainplan.specs.hf import model_from_hf  # it imports ModelSpec from here

        return model_from_hf(path)
    return load(ModelSpec, name)


def cluster_for(gpu: GPUSpec, given: str | None) -> tuple[str, str | None]:
    """(the cluster a verb uses, a note saying so where it was not given): `given`, else the
    one `gpu` names (A100 -> dgx-a100); a GPU that names none needs `--cluster`."""
    if given:
        return given, None
    if not gpu.cluster:
        raise SpecError(f"--cluster is needed: GPU {quote(gpu.name)} names no cluster (a "
                        f"'cluster:' field); presets: {preset_names(ClusterSpec)} or a YAML file")
    return gpu.cluster, (f"--cluster {gpu.cluster} (the cluster of --gpu {gpu.name}; pass "
                         "--cluster to choose another)")


def slice_name(model: str, layers: int) -> str:
    """The name of `model` cut to its first `layers` blocks, which `load_model` reads back."""
    return f"{model}:{layers}-layers"


def load_gpu_preset(name: str) -> GPUSpec:
    """A GPU preset (or YAML file) as its datasheet gives it, no calibration applied
    (`trainplan.calibrate.store.load_gpu` applies the card's calibration)."""
    return load(GPUSpec, name)


def load_cluster(name: str) -> ClusterSpec:
    return load(ClusterSpec, name)


def load_scenario(name: str) -> Scenario:
    return load(Scenario, name)


__all__ = [
    "DATA_DIR", "GiB", "ModelSpec", "GPUSpec", "ClusterSpec", "ParallelConfig", "Scenario",
    "LAYOUT_FIELDS", "PLAN_FIELDS", "SLICE", "SUITE_CLUSTER", "load", "load_model", "slice_name",
    "load_gpu_preset",
    "load_cluster", "load_scenario", "preset_names", "preset_of", "cluster_for",
    "from_mapping",
]
