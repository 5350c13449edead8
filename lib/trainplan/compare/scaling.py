"""Weak scaling from measured configs: tokens/s/GPU at n GPUs over the same at 1 GPU.

Weak scaling keeps the per-GPU work fixed (the same micro-batch on every
rank) and adds data-parallel ranks: ideal is a flat tokens/s/GPU, and the
efficiency at n GPUs is

    E(n) = (tokens/s/GPU at n) / (tokens/s/GPU at 1)

(target: at least 0.95 at 4 GPUs). A series is one data-parallel layout (ZeRO stage,
the shard group where HSDP replicates it, micro-batch, accumulation, recompute, compile,
model, kind of host, implementation; tp = pp = 1) over GPU counts (a host: its GPU count
and card, `compare.host`; points from different hosts are never put in one series). Its
1-GPU point is the 1-GPU measurement of the same layout; where none was run with the same
ZeRO stage, the plain one (zero 0, no sharding to do on one rank) stands in, and the series
says so. The interval of E is the ratio of the two rates' 95% intervals taken end against
end (low / high, high / low): conservative, as the two runs are independent.

Input: the rows of `trainplan.compare.accuracy.compare` (one per measured config).
"""

from __future__ import annotations

from collections import defaultdict

TARGET = 0.95
SERIES_KEYS = ("micro_batch", "grad_accum", "recompute", "compile")


def _family(row: dict) -> tuple:
    lay = row["layout"]
    return (row["model"], row.get("host", row["card"]), row["impl"],
            *(lay.get(k) for k in SERIES_KEYS))


def _data_parallel(row: dict) -> bool:
    lay = row["layout"]
    return lay["tp"] == 1 and lay["pp"] == 1 and lay.get("cp", 1) == 1 and lay["dp"] == row["gpus"]


def _hsdp_shard(row: dict) -> int | None:
    """The shard group's size where HSDP replicates it (1 < dp_shard < dp), else None."""
    lay = row["layout"]
    shard = lay.get("dp_shard") or lay["dp"]
    return shard if lay["zero"] > 0 and 1 < shard < lay["dp"] else None


def _name(lay: dict, hsdp: int | None = None) -> str:
    kind = "DDP" if lay["zero"] == 0 else f"FSDP2 ZeRO-{lay['zero']}"
    if hsdp:
        kind = f"HSDP {hsdp} x {lay['dp'] // hsdp} (ZeRO-{lay['zero']} in groups of {hsdp})"
    extra = f", {lay['recompute']} recompute" if lay["recompute"] != "none" else ""
    return (f"{kind}, mb {lay['micro_batch']}" + (f" x {lay['grad_accum']}"
            if lay["grad_accum"] > 1 else "") + extra + (", compiled" if lay["compile"] else ""))


def _point(row: dict, base: dict) -> dict:
    rate, (lo, hi) = row["measured_tokens_per_s_per_gpu"], row["measured_tokens_per_s_per_gpu_ci"]
    b_rate, (b_lo, b_hi) = (base["measured_tokens_per_s_per_gpu"],
                            base["measured_tokens_per_s_per_gpu_ci"])
    return {"gpus": row["gpus"], "config": row["config"], "launches": row["launches"],
            "tokens_per_s_per_gpu": rate, "tokens_per_s_per_gpu_ci": [lo, hi],
            "efficiency": rate / b_rate, "efficiency_ci": [lo / b_hi, hi / b_lo]}


def weak_scaling(rows: list[dict], target: float = TARGET) -> dict:
    """Series of weak-scaling efficiency per data-parallel layout (see the module docstring).

    A series needs a 1-GPU point and at least one more GPU count; rows that
    belong to none are left out. Where a layout was measured twice at one GPU
    count, the row with more launches counts.
    """
    ones, multi = defaultdict(dict), defaultdict(dict)
    for row in rows:
        if not _data_parallel(row) or not row.get("measured_tokens_per_s_per_gpu"):
            continue
        zero = row["layout"]["zero"]
        bucket = ones[_family(row)] if row["gpus"] == 1 \
            else multi[(_family(row), zero, _hsdp_shard(row))]
        slot = zero if row["gpus"] == 1 else row["gpus"]
        if slot not in bucket or row["launches"] > bucket[slot]["launches"]:
            bucket[slot] = row
    series = []
    for (family, zero, hsdp), by_gpus in multi.items():
        base = ones[family].get(zero) or ones[family].get(0)
        if base is None:
            continue
        points = [_point(base, base)] + [_point(by_gpus[n], base) for n in sorted(by_gpus)]
        last = points[-1]
        series.append({
            "name": _name({**by_gpus[max(by_gpus)]["layout"], "zero": zero}, hsdp),
            "model": family[0], "card": base["card"], "host": family[1], "impl": family[2],
            "zero": zero, "hsdp_shard": hsdp,
            "baseline": base["config"],
            "baseline_note": None if base["layout"]["zero"] == zero else
            "1-GPU point run without sharding (zero 0): nothing to shard on one rank",
            "points": points, "gpus_max": last["gpus"], "efficiency_at_max": last["efficiency"],
            "meets_target": last["efficiency"] >= target,
        })
    series.sort(key=lambda s: (s["model"], s["host"], s["zero"], s["hsdp_shard"] or 0, s["name"]))
    return {"definition": "tokens/s/GPU at n GPUs over tokens/s/GPU at 1 GPU, same per-GPU "
                          "micro-batch (weak scaling)", "target": target, "series": series}


def format_scaling(out: dict) -> str:
    """A few lines: per series, the efficiency at each GPU count with its interval."""
    if not out["series"]:
        return "weak scaling: no data-parallel layout measured at 1 GPU and at more"
    lines = [f"weak scaling (tokens/s/GPU at n over at 1; target >= {out['target']:.0%}):"]
    for s in out["series"]:
        pts = ", ".join(f"{p['gpus']} GPU {p['efficiency']:.1%} ({p['efficiency_ci'][0]:.1%}-"
                        f"{p['efficiency_ci'][1]:.1%})" for p in s["points"][1:])
        mark = "meets" if s["meets_target"] else "misses"
        lines.append(f"  {s['name']}, {s['model']} on {s['host']}: {pts}; {mark} the target"
                     + (" [1-GPU point: zero 0]" if s["baseline_note"] else ""))
    return "\n".join(lines)
