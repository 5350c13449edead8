"""Tensor parallel alone with per-block torch.compile trains as the uncompiled layout does.

The bug this guards: under `--tp 2 --compile` (no FSDP) the embedding's
sequence-parallel reduce-scatter hands the first compiled block an
AsyncCollectiveTensor; AOTAutograd (torch >= 2.12) unwraps it to its grad-less
inner tensor, so the block returned no input gradient and DTensor's
redistribute backward failed with "'Tensor' object has no attribute
'_local_tensor'" (`parallelize._resolve_async` is the fix).

Each compiled layout runs beside its uncompiled twin in one `torchrun`
launch of two gloo ranks (`trainplan.bench.series.sweep`), on the same seed and
synthetic batches, fp32 on CPU, and per-step losses and gradient norms must
agree within RTOL. The gradient norm is compared because the bug's quiet form
(an embedding that gets no gradient) moves the norm more plainly than the
loss. Inductor reorders fp32 reductions, so the curves differ by rounding
only: observed worst relative differences ~2e-7 for losses and gradient
norms, with and without sequence parallel; RTOL leaves a factor of 50. A
fresh Inductor cache per test makes the timing that of a cold start (about
30 s on 2 cores).
"""

from __future__ import annotations

import pytest

from .sweep_runs import run_sweep

RTOL = 1e-5
STEPS = 6
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 128\nvocab: 256\n"
BASE = ["--seq-len", "32", "--micro-batch", "2", "--steps", str(STEPS), "--warmup", "1",
        "--lr", "3e-3", "--seed", "0", "--synthetic", "--cpu"]

# tag -> train.py arguments; each "-compile" run is checked against the same tag without it.
LAYOUTS = {
    "tp2-sp": "--tp 2",
    "tp2-sp-compile": "--tp 2 --compile",
    "tp2-no-sp": "--tp 2 --no-sequence-parallel",
    "tp2-no-sp-compile": "--tp 2 --no-sequence-parallel --compile",
}


def _worst(mine: list[float], ref: list[float]) -> float:
    return max(abs(g - r) / abs(r) for g, r in zip(mine, ref, strict=True))


@pytest.mark.slow
def test_tp2_compile_matches_uncompiled(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    results = run_sweep(str(model), LAYOUTS, BASE, 2, tmp_path,
                        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    failures = []
    for tag in LAYOUTS:
        got = results.get(tag)
        if got is None or "error" in got:
            failures.append(f"{tag}: did not finish ({got and got.get('error')})")
    assert not failures, "\n".join(failures)
    for tag in (t for t in LAYOUTS if t.endswith("-compile")):
        got, ref = results[tag]["summary"], results[tag.removesuffix("-compile")]["summary"]
        assert got["layout"]["compile"] and not ref["layout"]["compile"]
        assert ref["losses"][-1] < ref["losses"][0], "the loss should fall, or this proves little"
        for key in ("losses", "grad_norms"):
            worst = _worst(got[key], ref[key])
            print(f"{tag}: worst relative {key} difference {worst:.1e}")
            if worst > RTOL:
                failures.append(f"{tag}: {key} {got[key]} vs uncompiled {ref[key]} "
                                f"(relative difference {worst:.2e} > {RTOL})")
    assert not failures, "\n".join(failures)
