"""Calibration: efficiency constants of one card from its microbenchmark records only.

    records of microbenchmarks -> calibration constants -> cost models

From `microbenchmark` records (`trainplan.bench.micro.run`) this module derives:

- matmul fraction: achieved / peak bf16 rate over the model's own forward
  GEMM shapes, weighted as the cost model spends time on them: total FLOPs
  over total time, each shape counted as often as a forward pass runs it
  (per layer x layers, the output layer once). The per-shape fractions are
  kept beside it. Records of other shapes (`bench.micro --matmul-tp
  --matmul-tokens`, config `base: false`) stay out of this constant and give
  the curve in GEMM size (`calibrate_pieces.matmul_curve`).
- attention fraction: the dense-equivalent rate of causal attention
  (forward + backward, 12 b a s^2 d FLOPs, twice the causal work done; the
  convention of `compute.attention_flops_per_token_per_layer`) over peak.
- collectives: per op, the alpha-beta model the planner uses
  (`comms.collective_time`): t = alpha + ring bytes / B, ring bytes
  2 (n-1)/n S for all-reduce and (n-1)/n S otherwise (nccl-tests
  doc/PERFORMANCE.md; Hockney 1994). alpha and 1/B are fitted by least
  squares on relative error, so 64 KiB and 1 GiB weigh alike; B is then the
  large-message bus bandwidth.

HBM streaming efficiency and the scales on the element-wise, head,
optimizer, activation and overlap terms come from the model-piece records
(`trainplan.calibrate.pieces`); where a piece was not measured the preset's
value stays, and the calibration file says so. A calibration is written to
data/hardware/calibration/<gpu preset>.yaml with the records it came from;
`trainplan.calibrate.store.load_gpu` applies it when one exists for the card.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from trainplan.calibrate import fp8 as calibrate_fp8
from trainplan.calibrate import host as calibrate_host
from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate.inputs import check_record
from trainplan.calibrate.store import COLLECTIVES, CalibrationError, card_preset, source_path
from trainplan.cost import comms
from trainplan.errors import SpecError
from trainplan.loader import quote, shown
from trainplan.records import schema as records
from trainplan.specs import GPUSpec, load_model

TMP_EXTRA = len("..XXXXXXXX.tmp")  # `write`'s temporary name: .NAME.XXXXXXXX.tmp (mkstemp)
GEMM_COUNT = {"q": 1, "kv": 2, "out": 1, "gate_up": 2, "up": 1, "down": 1}  # per layer


# ---------------------------------------------------------------- fits


def matmul_fraction(recs: list[dict], peak_tflops: float, n_layers: int | None) -> dict:
    """Forward-pass-weighted matmul fraction of peak: sum(c F) / sum(c t) / peak.

    c = times a forward pass runs the shape (GEMM_COUNT x n_layers, the
    output layer once; every shape once when the model is unknown), F = 2 M N K
    FLOPs, t = the median time of one call (`bench.micro`).
    """
    flops = time = 0.0
    shapes = []
    for r in recs:
        c, res = r["config"], r["results"]
        name = c.get("name", "")
        count = 1 if not n_layers else (GEMM_COUNT.get(name, 1) * n_layers
                                        if name != "output" else 1)
        f = 2.0 * c["m"] * c["n"] * c["k"]
        flops += count * f
        time += count * res["time_s"]
        shapes.append({"name": name, "m": c["m"], "n": c["n"], "k": c["k"], "count": count,
                       "tflops": round(res["tflops"], 1),
                       "fraction": round(res["tflops"] / peak_tflops, 4)})
    fractions = [s["fraction"] for s in shapes]
    return {"fraction": round(flops / time / 1e12 / peak_tflops, 4), "shapes": shapes,
            "spread": [min(fractions), max(fractions)],
            "token_counts": sorted({s["m"] for s in shapes})}


def dense_equivalent_tflops(rec: dict) -> float:
    """Attention rate credited with the full 12 b a s^2 d (twice the causal work done)."""
    res = rec["results"]
    if "tflops_dense_equiv" in res:
        return float(res["tflops_dense_equiv"])
    return float(res["tflops"]) * (2.0 if rec["config"].get("causal", True) else 1.0)


def attention_fraction(recs: list[dict], peak_tflops: float) -> dict:
    """Dense-equivalent attention FLOPs over total time, as a fraction of peak, at the shortest
    sequence recorded (longer ones run faster: they set `pieces.attention_curve`, and the
    planner reads the curve where there is one)."""
    shortest = min(r["config"]["seq"] for r in recs)
    base = [r for r in recs if r["config"]["seq"] == shortest]
    flops = sum(dense_equivalent_tflops(r) * r["results"]["time_s"] for r in base)
    time = sum(r["results"]["time_s"] for r in base)
    shapes = [{k: r["config"].get(k) for k in ("batch", "heads", "seq", "head_dim", "causal")}
              | {"tflops_dense_equiv": round(dense_equivalent_tflops(r), 1)} for r in recs]
    return {"fraction": round(flops / time / peak_tflops, 4), "shapes": shapes}


def attention_curve(recs: list[dict], peak_tflops: float) -> list[list[float]]:
    """[[seq, median dense-equivalent fraction of peak at that length], ...] sorted by seq,
    for `compute.attention_efficiency_at`; [] where one length was timed. From causal SDPA
    records (`bench.micro` attention, `--attention-seqs`); batches and head counts pool."""
    by_seq: dict[float, list[float]] = {}
    for r in recs:
        by_seq.setdefault(float(r["config"]["seq"]), []).append(
            dense_equivalent_tflops(r) / peak_tflops)
    if len(by_seq) < 2:
        return []
    return [[s, round(min(1.0, float(np.median(v))), 4)] for s, v in sorted(by_seq.items())]


def ring_bytes(op: str, size_bytes, n) -> np.ndarray:
    """Bytes a rank sends: 2 (n-1)/n S (all-reduce), (n-1)/n S (others); as `comms.ring_bytes`."""
    return np.asarray(comms.ring_bytes(op, size_bytes, n), dtype=float)


def fit_alpha_beta(xbytes, times) -> tuple[float, float]:
    """(alpha s, B bytes/s) minimising sum(((alpha + x / B) - t) / t)^2, alpha >= 0.

    Linear least squares in (alpha, 1/B) with each row divided by t; if the
    best alpha is negative, alpha = 0 and 1/B = sum(x/t) / sum((x/t)^2).
    """
    x, t = np.asarray(xbytes, dtype=float), np.asarray(times, dtype=float)
    if x.size < 2 or np.any(t <= 0) or np.any(x <= 0):
        raise CalibrationError(f"an alpha-beta fit needs >= 2 positive points; got {x.size}")
    a = np.column_stack([1.0 / t, x / t])
    (alpha, inv_b), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, inv_b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if inv_b <= 0:
        raise CalibrationError("alpha-beta fit gave a bandwidth <= 0; the timings do not "
                               "grow with message size")
    return float(alpha), float(1.0 / inv_b)


def collective_fit(recs: list[dict]) -> dict:
    """The alpha-beta fit of one op on one world size, with its relative errors per point."""
    op, n = recs[0]["config"]["op"], recs[0]["config"]["world"]
    sizes = np.array([r["config"]["size_bytes"] for r in recs], dtype=float)
    times = np.array([r["results"]["time_s"] for r in recs], dtype=float)
    x = ring_bytes(op, sizes, n)
    alpha, bw = fit_alpha_beta(x, times)
    err = np.abs((alpha + x / bw) / times - 1.0)
    big = int(np.argmax(sizes))
    return {"world": int(n), "latency_us": round(alpha * 1e6, 2),
            "busbw_gbps": round(bw / 1e9, 1), "points": int(len(recs)),
            "sizes_bytes": [int(sizes.min()), int(sizes.max())],
            "busbw_gbps_at_largest": round(float(x[big] / times[big] / 1e9), 1),
            "rel_error_median": round(float(np.median(err)), 4),
            "rel_error_max": round(float(err.max()), 4)}


# ---------------------------------------------------------------- build


def _source(path: Path, recs: list[dict]) -> dict:
    stamps = sorted(r["recorded_at"] for r in recs)
    commits = sorted({r.get("provenance", {}).get("git_commit") for r in recs}, key=str)
    runs = sorted({str(r.get("run_id")) for r in recs})
    return {"path": source_path(path), "records": len(recs), "run_ids": runs,
            "git_commits": commits,
            "recorded": [stamps[0], stamps[-1]]}


def _micro(path: Path, gpu: GPUSpec) -> list[dict]:
    """The microbenchmark records of `path`, each holding what the fits read (`check_record`)
    and measured on a card of preset `gpu`."""
    recs = [check_record(r, f"{shown(path)}:{n}") for n, r in enumerate(records.load(path), 1)
            if r["kind"] == "microbenchmark"]
    for r in recs:
        preset = card_preset(r["card"])
        if preset is not None and preset != gpu.name:
            raise CalibrationError(f"{path}: card {quote(r['card'])} is {preset}, not "
                                   f"{gpu.name}; pass --gpu {preset} or other records")
    return recs


def gather(paths, gpu: GPUSpec, host_paths=None) -> tuple[dict, list[dict], int | None]:
    """(records by bench, `sources`, host-bench records set aside) from the files.

    Without `host_paths` every microbenchmark record of `paths` counts and the count set
    aside is None. With them, the host-bench records (`calibrate_host.is_host`) come from
    `host_paths` only (their other records are left out) and those of `paths` are set aside:
    a source says `host_set_aside: n` where it lost n of them, a host file `host_only: true`
    (and `not_host_left_out: n` where it held others). A host file without any host-bench
    record, or a record of another card, is one CalibrationError.
    """
    by_bench, sources, set_aside = defaultdict(list), [], 0 if host_paths else None
    for path in map(Path, paths):
        recs = _micro(path, gpu)
        if host_paths:
            kept = [r for r in recs if not calibrate_host.is_host(r)]
            recs, dropped = kept, len(recs) - len(kept)
            set_aside += dropped
        for r in recs:
            by_bench[r["bench"]].append(r)
        if recs:
            sources.append(_source(path, recs) | ({"host_set_aside": dropped}
                                                  if host_paths and dropped else {}))
    for path in map(Path, host_paths or ()):
        every = _micro(path, gpu)
        recs = [r for r in every if calibrate_host.is_host(r)]
        if not recs:
            raise CalibrationError(
                f"--host-records {path}: no host-bench record (purpose host, interleave or "
                "host-step) in it; give the records of `python -m trainplan.bench.micro.run "
                "--benches host,host-step` on that machine")
        for r in recs:
            by_bench[r["bench"]].append(r)
        left = len(every) - len(recs)
        sources.append(_source(path, recs) | {"host_only": True}
                       | ({"not_host_left_out": left} if left else {}))
    return by_bench, sources, set_aside


def build(paths, gpu: GPUSpec, host_paths=None) -> dict:
    """A calibration of preset `gpu` from the microbenchmark records in `paths`.

    With `host_paths`, the host terms (`calibrate_host`: host_block_s, host_overlap_k,
    host_step_s, host_step_layer_s) come from the host-bench records of those files alone,
    e.g. re-measured on the machine to be planned for, and every other term from `paths`
    (`gather`); `host_records` then says which files and how many records were set aside.
    tp_block_scales take the host's time out of the TP blocks' (`calibrate_tp`), so they
    follow the host terms too.
    """
    by_bench, sources, set_aside = gather(paths, gpu, host_paths)
    for bench in ("matmul", "attention"):
        if not by_bench[bench]:  # the pieces' scales are relative to these two fractions
            raise CalibrationError(f"no {bench!r} microbenchmark records in {list(map(str, paths))}"
                                   "; run `python -m trainplan.bench.micro.run` first")
    base_mm = [r for r in by_bench["matmul"] if r["config"].get("base", True)]  # the model's own
    models = {r.get("model") for r in base_mm}  # others' GEMMs (--curve-only) feed the curve
    layers = None  # a model given as a YAML file is not a preset: weigh the shapes per layer
    if len(models) == 1 and None not in models:
        try:
            layers = load_model(models.pop()).n_layers
        except SpecError:
            pass
    mm = matmul_fraction(base_mm or by_bench["matmul"], gpu.bf16_tflops, layers)
    att = attention_fraction(by_bench["attention"], gpu.bf16_tflops)
    coll = {}
    for op in COLLECTIVES:
        worlds = defaultdict(list)
        for r in by_bench[op]:
            worlds[r["config"]["world"]].append(r)
        if worlds:  # the largest world measured stands for the node
            coll[op] = collective_fit(worlds[max(worlds)])
    n = sum(s["records"] for s in sources)
    day = max(s["recorded"][1] for s in sources)[:10]
    curve = attention_curve(by_bench["attention"], gpu.bf16_tflops)
    base = dataclasses.replace(  # the pieces are priced at the links just fitted (TP blocks)
        gpu, matmul_efficiency=mm["fraction"], attention_efficiency=att["fraction"],
        attention_curve=tuple(map(tuple, curve)),
        collectives=tuple((op, f["latency_us"], f["busbw_gbps"]) for op, f in sorted(coll.items())))
    scales, checks = calibrate_pieces.fit(by_bench, base)
    scales.update(calibrate_fp8.curves(by_bench["matmul-fp8"], gpu))
    scales.update(calibrate_fp8.cast_scales(by_bench["fp8-linear"],
                                            calibrate_pieces.apply(base, scales)))
    scales.update(calibrate_fp8.activation_ratios(by_bench["block-fp8"]))
    shares = [r["results"]["exposed_fraction"] for r in by_bench["overlap"]]
    exposed = float(np.median(shares)) if shares else 0.0  # pieces.fit: at most 1
    if curve:  # set before the pieces are fitted: block_terms prices attention with it
        scales = {"attention_curve": curve, **scales}
    return {
        "gpu": gpu.name, "card": sorted({r["card"] for v in by_bench.values() for r in v}),
        "label": f"{gpu.name} ({n} microbenchmark records, {day}"
                 + (f"; host terms from {', '.join(Path(p).name for p in host_paths)})"
                    if host_paths else ")"),
        "peak_bf16_tflops": gpu.bf16_tflops,
        "matmul_efficiency": mm["fraction"], "attention_efficiency": att["fraction"],
        "memory_efficiency": scales.get("memory_efficiency"),
        "pieces": scales, "block_checks": checks,
        "preset": {"matmul_efficiency": gpu.matmul_efficiency,
                   "attention_efficiency": gpu.attention_efficiency,
                   "memory_efficiency": gpu.memory_efficiency},
        "matmul": mm, "attention": att, "collectives": coll, "sources": sources,
        **({} if set_aside is None else {"host_records": {
            "from": [str(p) for p in host_paths], "set_aside": set_aside}}),
        "notes": [
            "memory_efficiency: " + ("device copy bandwidth / datasheet"
                                     if "memory_efficiency" in scales else
                                     "no HBM microbenchmark record; the preset's value is used"),
            "pieces: " + (", ".join(sorted(scales)) or "none measured; analytic terms unscaled"),
            f"matmul: forward GEMMs at {mm['token_counts']} tokens"
            + ("; other sizes (tp shards, token counts) in pieces.matmul_curve"
               if "matmul_curve" in scales else " only; other token counts are not measured")
            + "; backward shapes are not measured",
            "collectives: fitted on the largest world recorded, inside one node (NVLink); "
            "the planner uses them for groups inside a node, the cluster's figures across",
            *([f"host terms: the host-bench records of {[str(p) for p in host_paths]} only; "
               f"{set_aside} of the other files' set aside"] if host_paths else []),
            *([f"overlap: the measured exposed share, {exposed:.2f}, is above 1 (the GEMMs and "
               "the all-reduce ran slower together than apart); priced as 1"]
              if exposed > 1 else []),
        ],
    }


def write(calibration: dict, path: str | Path) -> Path:
    """Write a calibration as YAML to `path` (through a link: to the file it leads to): a new
    temporary file beside it, renamed into place when whole, so it is never half written."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("# written by `trainplan calibrate` from microbenchmark records only\n"
                    + yaml.safe_dump(calibration, sort_keys=False, width=100))
        os.chmod(tmp, 0o644)  # mkstemp's 0o600 would hide the calibration from the team
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _fmt(value, spec: str) -> str:
    return "not measured" if value is None else format(value, spec)


def summary_table(cal: dict):
    """A calibration's constants beside the preset's, as a pandas table (runbook page 4)."""
    import pandas as pd

    preset = cal.get("preset") or {}  # the datasheet figures, where the fit recorded them
    rows = [(name, _fmt(cal.get(key), ".3f"),
             format(preset[key], ".2f") if key in preset else "not recorded")
            for key, name in (
        ("matmul_efficiency", "matmul fraction of peak"),
        ("attention_efficiency", "attention fraction of peak (dense-equivalent)"),
        ("memory_efficiency", "HBM streaming fraction"))]
    pieces = cal.get("pieces") or {}
    for key, (name, uncalibrated) in calibrate_pieces.SCALE_NAMES.items():
        rows.append((name, _fmt(pieces.get(key), ".2f"), uncalibrated))
    for compiled, recompute, scale in pieces.get("activation_scales", []):
        rows.append((f"kept activations / analytic, {'compiled' if compiled else 'eager'}, "
                     f"recompute {recompute}", f"{scale:.2f}", "1 (analytic)"))
    for op, f in cal["collectives"].items():
        world = f", {f['world']} GPUs" if "world" in f else ""
        rows.append((f"{op.replace('_', '-')}{world}: latency, bus bandwidth",
                     f"{f['latency_us']:.1f} us, {f['busbw_gbps']:.0f} GB/s", "cluster preset"))
    out = pd.DataFrame({"calibrated": [r[1] for r in rows], "preset": [r[2] for r in rows]},
                       index=[r[0] for r in rows])
    out.index.name = None
    return out
