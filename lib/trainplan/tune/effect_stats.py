"""What the effects stage (`trainplan.tune.effects`) measured: each variant's paired effect
with its 95% interval and pair count, the knobs ranked per layout family, and the advice each
effect supports, in the words the recipe and `trainplan suggest` use.

An effect is 100 (exp(m) - 1) percent, m the mean of the pairs' log(variant / base) of
tokens/s/GPU, with the Student-t interval of m mapped the same way
(`trainplan.records.stats.paired_log_ratio`); its half-width is half that interval's width.
A knob's effect is its variant with the largest |effect|; knobs rank by it. Per knob:

- "set X (+a% +- b)": some value's interval lies above 0 (the largest such effect; for
  accumulation and micro-batch, which the design varies alone, the global batch changes);
- "leave default (effect within +-c%)": every interval contains 0, c = the larger of the
  half-width bound and the intervals' extent ("keep V" where the base is not at the default);
- "leave default (at X: -a% +- b)": no value helps and some value's interval lies below 0;
- "not measured on this layout family": no variant of the knob has two pairs there.

A `void` record (`{"record": "void", "study", "design", "variants": [ids], "why"}`, appended
after the fact) takes those variants' pairs recorded before it out of every figure, with the
reason shown: for pairs later found not to have measured what they name. A stage resumed after
the fault is fixed pairs them again, and those pairs count.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

from trainplan.loader import MAX_LOG_BYTES, json_lines, quote, shown
from trainplan.records.stats import paired_log_ratio
from trainplan.tune.knobs import EFFECT_KNOBS, SPACE
from trainplan.tune.study import StudyError

TERMINAL = ("pair", "failed", "interrupted")  # one of these ends every attempt
KINDS = ("design", "void", *TERMINAL)
NOT_MEASURED = "not measured on this layout family"
BATCH_KNOBS = ("grad_accum", "micro_batch")  # varied alone, each scales the global batch


def paths(storage_file: Path) -> tuple[Path, Path]:
    """(effects records, in-flight spend) files beside a study's storage file."""
    return (storage_file.with_name(storage_file.stem + "-effects.jsonl"),
            storage_file.with_name(storage_file.stem + "-effects.inflight.json"))


def read_records(path: Path) -> list[dict]:
    """The effects records of a study folder ([] when there are none), each checked to be a
    record this stage writes; anything else is one StudyError line."""
    if not Path(path).is_file():
        return []
    out = []
    for number, r in json_lines(path, error=StudyError, what="effects records",
                                max_bytes=MAX_LOG_BYTES):
        if not isinstance(r, dict) or r.get("record") not in KINDS or \
                not isinstance(r.get("study"), str) or not isinstance(r.get("design"), str):
            raise StudyError(f"{shown(path)}: line {number} is not an effects record "
                             f"({quote(r, 60)}); records are {list(KINDS)}")
        if r["record"] == "void" and not (
                isinstance(r.get("why"), str) and isinstance(r.get("variants"), list)
                and all(isinstance(v, str) for v in r["variants"])):
            raise StudyError(f"{shown(path)}: line {number} is a void record without a list "
                             f"of variant ids and a reason ({quote(r, 60)})")
        out.append(r)
    return out


def _pct(x: float) -> float:
    return 100.0 * math.expm1(x)


def voided(records: list[dict], study: str, design: str) -> dict[str, str]:
    """{variant id: why} of the variants that a `void` record of this design names."""
    return {v: r["why"] for r in records if r["record"] == "void" and r["study"] == study
            and r["design"] == design for v in r["variants"]}


def struck(records: list[dict], study: str, design: str) -> set[int]:
    """Positions in `records` of this design's pairs that a later `void` record names."""
    out, named = set(), set()
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        if r["study"] != study or r["design"] != design:
            continue
        if r["record"] == "void":
            named.update(r["variants"])
        elif r["record"] == "pair" and r["variant"] in named:
            out.add(i)
    return out


def tally(records: list[dict], study: str, design: str) -> dict:
    """Attempts, pairs, failures, each variant's rates and struck pairs so far of one design
    (a struck pair, `struck`, counts as an attempt only)."""
    rates, failures, attempts, pairs = defaultdict(list), Counter(), 0, 0
    gone = struck(records, study, design)
    for i, r in enumerate(records):
        if r["study"] != study or r["design"] != design or r["record"] not in TERMINAL:
            continue
        attempts += 1
        if i in gone:
            continue
        if r["record"] == "pair":
            pairs += 1
            rates[r["variant"]].append((r["variant_run"]["tokens_per_s_per_gpu"],
                                        r["base_run"]["tokens_per_s_per_gpu"]))
        elif r["record"] == "failed":  # counted per variant, and for the base
            failures["base" if r["side"] == "base" else r["variant"]] += 1
    half = {k: effect(v)["halfwidth_pct"] for k, v in rates.items()}
    return {"rates": rates, "halfwidth": {k: h for k, h in half.items() if h is not None},
            "failures": failures, "attempts": attempts, "pairs": pairs,
            "struck": Counter(records[i]["variant"] for i in gone)}


def effect(pairs: list[tuple[float, float]]) -> dict:
    """{pairs, effect_pct, ci_pct, halfwidth_pct} of (variant, base) rates; no interval
    (None) below two pairs."""
    if not pairs:
        return {"pairs": 0, "effect_pct": None, "ci_pct": None, "halfwidth_pct": None}
    ci = paired_log_ratio([p[0] for p in pairs], [p[1] for p in pairs])
    if not ci.enough:
        return {"pairs": ci.n, "effect_pct": _pct(ci.estimate), "ci_pct": None,
                "halfwidth_pct": None}
    lo, hi = _pct(ci.low), _pct(ci.high)
    return {"pairs": ci.n, "effect_pct": _pct(ci.estimate), "ci_pct": [lo, hi],
            "halfwidth_pct": (hi - lo) / 2}


def variant_rows(records: list[dict], head: dict) -> list[dict]:
    """One row per variant of a design: its value, the base's, pairs, effect and interval."""
    state = tally(records, head["study"], head["design"])
    void = voided(records, head["study"], head["design"])
    return [{"variant": v["id"], "knob": v["knob"], "value": v["value"],
             "base_value": head["base"][v["knob"]], "failed": state["failures"].get(v["id"], 0),
             **effect(state["rates"].get(v["id"], [])),
             **({"void": void[v["id"]], "struck": state["struck"][v["id"]]}
                if v["id"] in void else {})} for v in head["variants"]]


def advice(row: dict, bound: float) -> tuple[str, str, object]:
    """(verdict, words, the value to set or None) of one knob row: verdict 'set', 'leave' or
    'not measured' (module docstring)."""
    measured = [v for v in row["variants"] if v["ci_pct"] is not None]
    if not measured:
        return "not measured", NOT_MEASURED, None
    better = [v for v in measured if v["ci_pct"][0] > 0]
    if better:
        v = max(better, key=lambda v: v["effect_pct"])
        batch = "; the global batch changes with it" if row["knob"] in BATCH_KNOBS else ""
        return ("set", f"set {v['value']} ({v['effect_pct']:+.1f}% +- "
                f"{v['halfwidth_pct']:.1f}{batch})", v["value"])
    base = row["base_value"]
    keep = "leave default" if base == SPACE[row["knob"]].default else f"keep {base}"
    worse = [v for v in measured if v["ci_pct"][1] < 0]
    if worse:
        return "leave", f"{keep} (" + ", ".join(
            f"at {v['value']}: {v['effect_pct']:+.1f}% +- {v['halfwidth_pct']:.1f}"
            for v in worse) + ")", None
    c = max(bound, *(max(abs(v["ci_pct"][0]), abs(v["ci_pct"][1])) for v in measured))
    return "leave", f"{keep} (effect within +-{c:.1f}%)", None


def knob_rows(variants: list[dict], head: dict) -> list[dict]:
    """Every knob of `EFFECT_KNOBS`: its variants, the largest |effect|, pairs and advice."""
    why_out = {x["knob"]: x["why"] for x in head["left_out"] if "value" not in x}
    skipped = defaultdict(list)  # knob -> "value: reason" of the values the skip rules refused
    for x in head["left_out"]:
        if "value" in x:
            skipped[x["knob"]].append(f"{x['value']}: {x['why']}")
    rows = []
    for knob in EFFECT_KNOBS:
        mine = [v for v in variants if v["knob"] == knob]
        sized = [v for v in mine if v["ci_pct"] is not None]
        top = max(sized, key=lambda v: abs(v["effect_pct"]), default=None)
        row = {"knob": knob, "base_value": head["base"].get(knob), "variants": mine,
               "pairs": sum(v["pairs"] for v in mine),
               "effect_pct": top and top["effect_pct"], "ci_pct": top and top["ci_pct"],
               "halfwidth_pct": top and top["halfwidth_pct"], "value": top and top["value"],
               "effect_pairs": top["pairs"] if top else 0,
               "not_varied": why_out.get(knob) or (None if mine else "; ".join(
                   skipped[knob]) or "not in the design")}
        voids = sorted({v["void"] for v in mine if "void" in v and not v["pairs"]})
        if voids and not sized and row["not_varied"] is None:
            row["not_varied"] = "; ".join(voids)
        row["verdict"], row["advice"], row["set_value"] = advice(row, head["halfwidth_pct"])
        rows.append(row)
    return rows


def summary(records: list[dict], study: str, where: dict | None = None) -> dict | None:
    """The effects of one study: every design (marked `where`: model, GPUs, card), and per
    layout family the design with the most pairs, its knobs ranked by |effect| (top 3) and
    all its knobs; None without any."""
    heads = [r for r in records if r["record"] == "design" and r["study"] == study]
    if not heads:
        return None
    designs = []
    for head in heads:
        knobs_ = knob_rows(variant_rows(records, head), head)
        ranked = sorted((k for k in knobs_ if k["ci_pct"] is not None),
                        key=lambda k: -abs(k["effect_pct"]))
        designs.append({
            "design": head["design"], "family": head["family"], "base": head["base"],
            "base_from": head["base_from"], "halfwidth_pct": head["halfwidth_pct"],
            "pairs": sum(k["pairs"] for k in knobs_),
            "gpu_hours": sum(float(r.get("gpu_seconds", 0.0)) for r in records
                             if r["study"] == study and r["design"] == head["design"]) / 3600,
            "top_knobs": ranked[:3], "knobs": knobs_, "left_out": head["left_out"],
            **({"where": where} if where else {})})
    return join([{"designs": designs}])


def join(summaries: list[dict | None]) -> dict | None:
    """Several studies' effects as one: all their designs, and per layout family the design
    on the most GPUs (where communication shows most), then with the most pairs; None when
    none has any."""
    designs = [d for s in summaries if s for d in s["designs"]]
    if not designs:
        return None

    def rank(d):
        return ((d.get("where") or {}).get("gpus") or 0, d["pairs"])

    families = {}
    for d in designs:
        if d["family"] not in families or rank(d) > rank(families[d["family"]]):
            families[d["family"]] = d
    return {"designs": designs, "families": families,
            "gpu_hours": sum(d["gpu_hours"] for d in designs)}


def where(d: dict, sep: str = " on ") -> str:
    """Where a design ran, "MODEL on N x CARD" (`sep` between), or "" where the records do
    not say."""
    w = d.get("where") or {}
    return f"{w['model']}{sep}{w['gpus']} x {w['card']}" if w.get("card") else ""


def family_advice(eff: dict | None, family: str) -> dict:
    """{knob: {verdict, advice, set_value, value, effect_pct, ci_pct, pairs}} for a layout
    family (`value`: the variant of the largest |effect|); every knob
    'not measured on this layout family' where the study has no effects there."""
    d = (eff or {}).get("families", {}).get(family)
    rows = {k["knob"]: k for k in d["knobs"]} if d else {}
    keys = ("verdict", "advice", "set_value", "value", "effect_pct", "ci_pct", "pairs")
    return {knob: {k: rows[knob][k] for k in keys} if knob in rows else
            {"verdict": "not measured", "advice": NOT_MEASURED, "set_value": None,
             "value": None, "effect_pct": None, "ci_pct": None, "pairs": 0}
            for knob in EFFECT_KNOBS}


def _interval(k: dict) -> str:
    return (f"{k['value']} {k['effect_pct']:+.1f}% +- {k['halfwidth_pct']:.1f} "
            f"({k['effect_pairs']} pairs)")


def format_lines(eff: dict | None) -> list[str]:
    """The effects in the text report: per family, the top 3, then every knob's advice."""
    if not eff:
        return ["  effects: the paired effects stage has not run (--effects-share)"]
    lines = ["  effects (paired launches, 95% Student-t intervals), per layout family:"]
    for fam, d in eff["families"].items():
        on = f"{where(d)}, " if where(d) else ""
        lines.append(f"    {fam}: {on}base {d['base_from']}, {d['pairs']} pairs, "
                     f"{d['gpu_hours']:.3f} GPU-hours")
        lines.append("      top: " + ("; ".join(f"{k['knob']} {_interval(k)}"
                                               for k in d["top_knobs"]) or "none yet"))
        for k in d["knobs"]:
            shown_ = ", ".join(f"{v['value']} {v['effect_pct']:+.1f}% +- "
                               f"{v['halfwidth_pct']:.1f} (n={v['pairs']})"
                               for v in k["variants"] if v["ci_pct"] is not None)
            lines.append(f"      {k['knob']}: {k['advice']}" + (f"; {shown_}" if shown_ else "")
                         + (f" [{k['not_varied']}]" if k["not_varied"] else ""))
    return lines


def recipe_sentence(eff: dict | None) -> str:
    """The effects in plain words for the recipe page (markdown): per family where it ran and
    its three largest effects; each knob's advice is `advice_table`'s."""
    if not eff:
        return ("The paired effects stage has not run on this study yet: no knob is measured "
                "on any layout family, so keep the defaults.")
    parts = []
    for fam, d in eff["families"].items():
        top = "; ".join(f"`{k['knob']}` {_interval(k)}" for k in d["top_knobs"]) or "none yet"
        on = f"{where(d)}, " if where(d) else ""
        parts.append(f"On **{fam}** ({on}{d['pairs']} pairs around {d['base_from']}, "
                     f"95% intervals) the largest effects are {top}.")
    return " ".join(parts) + " The table below gives each knob's advice on each family."


def advice_table(eff: dict | None) -> dict[str, dict[str, str]]:
    """{family, with where it ran: {knob: advice}} for every knob of every family measured,
    a knob not measured there with the reason."""
    out = {}
    for fam, d in (eff or {}).get("families", {}).items():
        column = f"{fam} ({where(d, ', ')})" if where(d) else fam
        out[column] = {k["knob"]: k["advice"] + (
            f" ({k['not_varied']})" if k["verdict"] == "not measured" and k["not_varied"]
            else "") for k in d["knobs"]}
    return out
