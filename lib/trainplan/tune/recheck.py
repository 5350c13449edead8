"""The knob study's top knobs re-checked on a larger host, one knob at a time.

A re-check folder (data/measurements/knobs-*/) holds one `trainplan validate` call of a
suite whose first config is the study's best and whose others each change one knob:
`predictions.jsonl` (one per config, recorded first), `measurements.jsonl`, the call's
`validate.json`, and the suite it ran (`SUITE`; the call may have run configs of other
suites too, whose records live elsewhere). Each config's launches are
pooled with `records.combine_launches`; its effect is its tokens/s/GPU over the first
config's, and it counts as measurable only where the two 95% intervals do not overlap
(docs/measurement.md, "Timing").

Records written before the harness named its suite tag carry only their layout, and two
configs may share one (loader workers 1 vs 0). Those are assigned to configs in the
call's order, as `validate.json` lists them with their launch counts, and each assignment
is checked against the config's layout; a mismatch is refused, not guessed.
"""

from __future__ import annotations

from pathlib import Path

from trainplan.bench.series.suite import full_layout, load_suite
from trainplan.errors import RecordError
from trainplan.loader import MAX_LOG_BYTES, load_json, shown
from trainplan.records import schema as records

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "data" / "measurements" / "knobs-h200x4-20261126"
SUITE = ROOT / "data" / "suites" / "knobs-4gpu.yaml"
LOADER_FLAGS = {"--num-workers": "num_workers", "--prefetch-factor": "prefetch_factor"}
COMPARED = ("micro_batch", "grad_accum", "zero", "recompute")


def _settings(suite: dict, cfg: dict) -> dict:
    """The knobs a config sets: its layout's and its loader flags'."""
    lay = full_layout(cfg)
    out = {k: lay[k] for k in COMPARED}
    args = [str(a) for a in cfg.get("extra_args", suite.get("extra_args", []))]
    for flag, name in LOADER_FLAGS.items():
        out[name] = int(args[args.index(flag) + 1]) if flag in args else None
    return out


def change(base: dict, other: dict) -> str:
    """The knobs `other` changes from `base`, in words ("micro_batch 16 -> 4")."""
    diff = [f"{k} {base[k]} -> {other[k]}" for k in base if base[k] != other[k]]
    return ", ".join(diff) or "none (the start point)"


def _assign(folder: Path, configs: list[dict], measurements: list[dict]) -> dict[str, list]:
    """Launches per tag: the record's own tag, else the call's order (checked by layout)."""
    by_tag = {c["tag"]: [] for c in configs}
    untagged = [m for m in measurements if not m.get("tag")]
    for m in measurements:
        if m.get("tag"):
            by_tag.setdefault(m["tag"], []).append(m)
    if untagged:
        order = load_json(folder / "validate.json", error=RecordError,
                          max_bytes=MAX_LOG_BYTES)["configs"]
        it = iter(sorted(untagged, key=lambda r: r["recorded_at"]))  # ISO, one time zone
        mine = {c["tag"]: c for c in configs}
        for entry in (e for e in order if e["tag"] in mine):  # the call may run other suites
            want = mine[entry["tag"]]
            for _ in range(entry.get("launches", 0)):
                m = next(it, None)
                if m is None:
                    raise RecordError(f"{folder}: validate.json lists more launches of "
                                      f"{entry['tag']!r} than measurements.jsonl holds")
                lay = full_layout(want)
                if any(m["layout"][k] != lay[k] for k in COMPARED[:3]):
                    raise RecordError(f"{folder}: a launch of layout {m['layout']} cannot be "
                                      f"config {entry['tag']!r} (layout {lay})")
                by_tag[entry["tag"]].append(m)
    return by_tag


def recheck(folder: str | Path = COMMITTED, suite_path: str | Path = SUITE) -> dict | None:
    """{"card", "gpus", "base", "rows": [{"tag", "change", "launches", "tokens_per_s_per_gpu",
    "ci", "effect_pct", "measurable"}]} of a re-check folder; None when it is absent."""
    folder = Path(folder)
    if not (folder / "measurements.jsonl").is_file():
        return None
    suite = load_suite(str(suite_path))
    configs = suite["configs"]
    path = folder / "measurements.jsonl"
    launches = _assign(folder, configs, [{**r, "_where": f"{shown(path)}:{n}"} for n, r in
                                         enumerate(records.load(path), start=1)])
    base_cfg = configs[0]
    base = _settings(suite, base_cfg)
    pooled = {c["tag"]: records.combine_launches(launches[c["tag"]])
              for c in configs if launches.get(c["tag"])}
    if base_cfg["tag"] not in pooled:
        raise RecordError(f"{folder}: the start point {base_cfg['tag']!r} was not measured")
    ref = pooled[base_cfg["tag"]]
    rows = []
    for c in configs:
        p = pooled.get(c["tag"])
        row = {"tag": c["tag"], "change": change(base, _settings(suite, c)),
               "launches": p["launches"] if p else 0}
        if p:
            lo, hi = p["tokens_per_s_per_gpu_ci"]
            rlo, rhi = ref["tokens_per_s_per_gpu_ci"]
            row.update(tokens_per_s_per_gpu=p["tokens_per_s_per_gpu"], ci=[lo, hi],
                       effect_pct=100.0 * (p["tokens_per_s_per_gpu"]
                                           / ref["tokens_per_s_per_gpu"] - 1.0),
                       measurable=c is not base_cfg and (hi < rlo or lo > rhi))
        rows.append(row)
    first = launches[base_cfg["tag"]][0]
    return {"card": first["card"], "gpus": first["gpus"], "base": base_cfg["tag"], "rows": rows}


def sentence(out: dict) -> str:
    """The re-check in one paragraph of plain words, figures from `out`."""
    parts = []
    for r in out["rows"][1:]:
        if not r["launches"]:
            parts.append(f"`{r['change']}` was not run (the call's time ran out)")
            continue
        verdict = ("the intervals are apart: a measurable effect" if r["measurable"]
                   else "the intervals overlap: no measurable effect")
        parts.append(f"`{r['change']}` changed tokens/s/GPU by {r['effect_pct']:+.1f}% "
                     f"({verdict})")
    return (f"On {out['gpus']} x {out['card']}, one knob at a time from the study's best "
            f"configuration ({out['rows'][0]['launches']} launches each): "
            + "; ".join(parts) + ".")


def table(out: dict):
    """The re-check as a table for the page: one row a config, figures rounded for reading."""
    import pandas as pd

    def interval(r):
        return f"{r['ci'][0]:,.0f}-{r['ci'][1]:,.0f}" if r.get("ci") else "not run"

    return pd.DataFrame([{
        "config": r["tag"], "change": r["change"], "launches": r["launches"],
        "tokens/s/GPU": f"{r['tokens_per_s_per_gpu']:,.0f}" if r["launches"] else "",
        "95% interval": interval(r),
        "vs start": f"{r['effect_pct']:+.1f}%" if r["launches"] else "",
        "measurable": ("start point" if r["tag"] == out["base"]
                       else "yes" if r.get("measurable") else "no" if r["launches"] else ""),
    } for r in out["rows"]]).set_index("config")
