"""Loss parity: every layout gloo can run gives a single process's loss curve.

Each layout trains a tiny Llama (4 layers, hidden 64, 4 heads, 2 key/value
heads, FFN 128, vocab 256, sequence 32) for STEPS AdamW steps in fp32 on CPU
under real `torchrun` with gloo, from the same seed and on the same global
batches (`feed.SyntheticBatches`), and its per-step losses and gradient
norms must match a single process that accumulates the same micro-batches:
relative tolerance RTOL. The gradient norm is compared too because Adam is
blind to a gradient scale error (a sum where a mean belongs) that the loss
alone would not show. Observed differences: 0 or ~1e-7 for DDP, FSDP2 and
pipeline layouts, up to ~5e-7 where tensor parallel splits the matmul
reductions (gradient norm ~5e-6 at tp 2-4, ~3e-5 at tp 8), ~1e-7 (loss) and
~7e-6 (gradient norm) with `--loss fused`; RTOL leaves a factor of 4 or more.

Layouts run in groups, one launch per world size (`trainplan.bench.series.sweep`),
shared by the cases of that size whichever xdist worker runs them: starting
torch and gloo, and DTensor's first step, are most of the cost on a small
machine.
"""

from __future__ import annotations

import functools

import pytest

from trainplan.bench.harness import train

from .sweep_runs import shared_sweep

RTOL = 1e-4
STEPS = 5
TINY = "n_layers: 4\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
BASE = ["--seq-len", "32", "--micro-batch", "2", "--steps", str(STEPS), "--warmup", "1",
        "--lr", "3e-3", "--seed", "0", "--synthetic", "--cpu"]

# tag -> train.py arguments. (dp, grad_accum) decide the reference single process.
DATA_PARALLEL_2 = {
    "ddp": "--dp 2",
    "ddp-accum2": "--dp 2 --grad-accum 2",
    "fsdp-zero1": "--dp 2 --zero 1",
    "fsdp-zero2-accum2": "--dp 2 --zero 2 --grad-accum 2",
    "fsdp-zero3": "--dp 2 --zero 3",
    "fsdp-zero3-accum2": "--dp 2 --zero 3 --grad-accum 2",
    "fsdp-zero3-full-ac": "--dp 2 --zero 3 --recompute full",
    "fsdp-zero2-selective-ac": "--dp 2 --zero 2 --recompute selective",
    "hsdp-replicate2": "--dp 2 --zero 3 --dp-shard 1",
    # the fused loss (harness/loss.py) against the standard loss's single process
    "ddp-fused": "--dp 2 --loss fused",
    "fsdp-zero2-accum2-fused": "--dp 2 --zero 2 --grad-accum 2 --loss fused --loss-chunk 24",
    "fsdp-zero3-accum2-fused": "--dp 2 --zero 3 --grad-accum 2 --loss fused",
    "hsdp-replicate2-fused": "--dp 2 --zero 3 --dp-shard 1 --loss fused",
}
MODEL_PARALLEL_2 = {
    "tp2-sp": "--tp 2",
    "tp2-no-sp": "--tp 2 --no-sequence-parallel",
    "tp2-sp-selective-ac-accum2": "--tp 2 --recompute selective --grad-accum 2",
    "pp2-1f1b": "--pp 2 --grad-accum 2",
    "pp2-gpipe": "--pp 2 --grad-accum 4 --pp-schedule gpipe",
    "pp2-interleaved-v2": "--pp 2 --grad-accum 2 --pp-schedule interleaved --pp-virtual 2",
    "pp2-1f1b-full-ac": "--pp 2 --grad-accum 2 --recompute full",
}
LAYOUTS_4 = {
    "fsdp2-x-tp2": "--dp 2 --zero 3 --tp 2",
    "ddp2-x-tp2": "--dp 2 --tp 2",
    "hsdp-2x2": "--dp 4 --zero 3 --dp-shard 2",
    "pp2-x-fsdp2": "--pp 2 --dp 2 --zero 3 --grad-accum 2",
    "pp2-x-ddp2": "--pp 2 --dp 2 --grad-accum 2",
    "pp2-x-tp2": "--pp 2 --tp 2 --grad-accum 2",
}

# 8 heads and 8 key/value heads, so tensor parallel can split them 4 and 8 ways: the layouts
# of the 4-GPU (issue 9) and full-node (issue 10) runs, on gloo ranks.
TINY8 = "n_layers: 4\nhidden: 64\nn_heads: 8\nn_kv_heads: 8\nffn: 128\nvocab: 256\n"
LAYOUTS_4_WIDE = {
    "tp4": "--tp 4",
    "pp4-1f1b": "--pp 4 --grad-accum 4",
    "fsdp4-zero2": "--dp 4 --zero 2",
    "pp2-x-fsdp2-zero2": "--pp 2 --dp 2 --zero 2 --grad-accum 2",
}
LAYOUTS_8 = {
    "tp8": "--tp 8",
    "tp4-x-fsdp2": "--tp 4 --dp 2 --zero 3",
    "fsdp8-zero3": "--dp 8 --zero 3",  # ZeRO-2's reshard rule: fsdp4-zero2, fsdp-zero2-*
    "pp2-x-tp4": "--pp 2 --tp 4 --grad-accum 2",
}


def _micro_batches(args: list[str]) -> int:
    """Micro-batches per step over all replicas: what the single process accumulates."""
    def value(flag):
        return int(args[args.index(flag) + 1]) if flag in args else 1
    return value("--dp") * value("--grad-accum")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The tiny model files by name: TINY (4 heads, 2 key/value) and TINY8 (8 and 8)."""
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for name, text in (("tiny", TINY), ("tiny8", TINY8)):
        (root / f"{name}.yaml").write_text(text)
        out[name] = str(root / f"{name}.yaml")
    return out


# case id: (model, layouts, ranks)
CASES = {
    "dp-2": ("tiny", DATA_PARALLEL_2, 2),  # data parallel on two ranks
    "tp-pp-2": ("tiny", MODEL_PARALLEL_2, 2),  # tensor and pipeline parallel on two ranks
    "compositions-4": ("tiny", LAYOUTS_4, 4),  # compositions on four ranks
    "suite-4": ("tiny8", LAYOUTS_4_WIDE, 4),  # the layouts of the 4-GPU suite
    "full-node-8": ("tiny8", LAYOUTS_8, 8),  # the full node's layouts
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, models):
    """{case: {tag: sweep line}} of the cases of `ranks` ranks: one launch of all their
    layouts, once per session (`shared_sweep`)."""
    def of(ranks: int) -> dict[str, dict]:
        runs = [{"tag": f"{case}/{tag}", "args": ["--model", models[model], *BASE, *a.split()]}
                for case, (model, layouts, n) in CASES.items() if n == ranks
                for tag, a in layouts.items()]
        lines = shared_sweep(tmp_path_factory, f"parity-{ranks}", runs, ranks)
        out: dict[str, dict] = {}
        for key, line in lines.items():
            case, _, tag = key.partition("/")
            out.setdefault(case, {})[tag] = line
        return out
    return of


@functools.cache
def _reference(tiny_yaml: str, micro: int) -> dict:
    args = train.parse_args(["--model", tiny_yaml, *BASE, "--grad-accum", str(micro), "--json"])
    return train.run(args)


def _check(tiny_yaml: str, layouts: dict[str, str], results: dict[str, dict]) -> None:
    refs: dict[int, dict] = {}
    failures = []
    for tag, a in layouts.items():
        micro = _micro_batches(a.split())
        if micro not in refs:
            refs[micro] = _reference(tiny_yaml, micro)
        got = results.get(tag)
        if got is None or "error" in got:
            failures.append(f"{tag}: {got and got.get('error')}")
            continue
        for key in ("losses", "grad_norms"):
            mine, ref = got["summary"][key], refs[micro][key]
            worst = max(abs(g - r) / abs(r) for g, r in zip(mine, ref, strict=True))
            print(f"{tag}: worst relative {key} difference {worst:.1e}")
            if worst > RTOL:
                failures.append(f"{tag}: {key} {mine} vs single process {ref} "
                                f"(relative difference {worst:.2e} > {RTOL})")
    for ref in refs.values():
        losses = ref["losses"]
        assert losses[-1] < losses[0], "the reference loss should fall, or parity proves little"
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_layouts_match_single_process(models, launched, case):
    model, layouts, ranks = CASES[case]
    _check(models[model], layouts, launched(ranks).get(case, {}))
