"""The recipe page's words from a knob study's report (`report.committed`): what to set, what
to avoid and what to leave alone, only as far as the study measured it; the paired effects
stage's sentence (`effect_stats.recipe_sentence`); what is still to be measured; and where a
scenario's plan sits against the study's advice."""

from __future__ import annotations

from trainplan.tune import effect_stats


def recipe_sentences(rep: dict | None, recheck: dict | None = None) -> dict[str, str]:
    """The recipe page's plain-words sentences (markdown) from a report, or for no study yet.

    Only what the study measured is said: a knob is recommended only where a
    level beats its default with an interval above 0, and named as "leave
    alone" only where every interval contains 0. `effects`: the paired effects
    per layout family, in `effect_stats.recipe_sentence`'s words.
    """
    return {**_search_sentences(rep, recheck),
            "effects": effect_stats.recipe_sentence((rep or {}).get("effects"))}


def _search_sentences(rep: dict | None, recheck: dict | None) -> dict[str, str]:
    if rep is None or not rep["trials"]:
        return {
            "status": "**No GPU study is committed yet.** The study code runs end to end on the "
                      "CPU proxy in the tests, but no knob has been measured on GPUs, so this "
                      "page claims no effect for any knob.",
            "decision": "Keep NCCL and the data loader at their defaults (`NCCL_ALGO` and "
                        "`NCCL_PROTO` unset) until the knob study has run: no knob has a "
                        "measured effect here yet.",
            "risk": "Until the study runs, nothing here says which knob matters on these GPUs.",
            "missing": "**The GPU study.** Its one-call command (a device run that resumes the "
                       "study on each call) is in the docstring of `trainplan.tune.study`; its "
                       "storage and measurement records will live in `data/measurements/`. "
                       "Then the recipe itself: the top knobs with their effects and intervals, "
                       "what to leave alone, and the figures above."}
    paired = _paired_knobs(rep)
    gains, alone, avoid = [], [], []
    for k in (k for k in rep["knobs"] if k["knob"] not in paired):
        avoid += [f"`{k['knob']}` {e['level']} ({e['effect_pct']:+.1f}%, 95% interval "
                  f"{e['ci_pct'][0]:+.1f} to {e['ci_pct'][1]:+.1f}%)"
                  for e in k["effects"] if e["ci_pct"][1] < 0]
        better = [e for e in k["effects"] if e["ci_pct"][0] > 0]
        if better:
            e = max(better, key=lambda e: e["effect_pct"])
            gains.append(f"`{k['knob']}` {e['level']} ({e['effect_pct']:+.1f}% against "
                         f"{e['vs']}, 95% interval {e['ci_pct'][0]:+.1f} to "
                         f"{e['ci_pct'][1]:+.1f}%)")
        elif k["verdict"] == "no measurable effect":
            alone.append(f"`{k['knob']}`")
    status = (f"The committed study `{rep['study']}` measured {rep['trials']} configurations of "
              f"`{rep['model']}` on {rep['gpus']} x {rep['card']} in {rep['gpu_hours']:.2f} "
              "GPU-hours.")
    if not any(k["effects"] for k in rep["knobs"]):  # too few trials for any interval
        b = rep["best"]
        fastest = ", ".join(f"{k} {v}" for k, v in b["config"].items() if v is not None)
        decision = (f"The study is too small yet to estimate any knob's effect with an interval "
                    f"({rep['trials']} configurations): keep the defaults until it is complete. "
                    f"The fastest configuration measured so far ({fastest}) ran "
                    f"{b['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (95% interval "
                    f"{b['ci'][0]:,.0f}-{b['ci'][1]:,.0f}): one measurement, not a knob effect.")
        caveat = " ".join(rep.get("importance_caveats", []))
        return {"status": status, "decision": decision,
                "risk": "With this few configurations, which knob matters is not known yet; the "
                        "study resumes from its committed storage.",
                "missing": f"**The rest of the GPU study.** {rep['trials']} configurations are "
                           "measured, too few for any knob level's effect with an interval (the "
                           "study resumes from its committed storage). The importance figure "
                           "above ranks knobs from these trials alone"
                           + (f" (PED-ANOVA warns: {caveat})" if caveat else "") + "."}
    decision = ("Set " + "; ".join(gains) + "." if gains else
                "No knob beat its default with an interval above zero: keep the defaults.")
    if avoid:
        decision += " Avoid: " + "; ".join(avoid) + "."
    if alone:
        decision += " Leave alone (no measurable effect): " + ", ".join(alone) + "."
    if paired:
        decision += (" The NCCL, loader, accumulation and micro-batch knobs are judged by the "
                     "paired effects below, one knob at a time against the same base.")
    if recheck and recheck["gpus"] > rep["gpus"]:  # else it re-checked an earlier study
        decision += _recheck_sentence(recheck)
    return {"status": status, "decision": decision,
            "risk": "The study ran on the proxy at one scale; effects on a larger job can "
                    "differ, so measure the top knobs again on the real job's first hour.",
            "missing": _missing_on_more_gpus(rep, recheck)}


def _paired_knobs(rep: dict | None) -> set[str]:
    """The knobs the paired stage judges where it has run (its intervals are a few percent,
    the search's joint fit's tens): the search's effects speak only for the others."""
    return set(effect_stats.EFFECT_KNOBS) if ((rep or {}).get("effects") or {}).get(
        "families") else set()


def _recheck_sentence(recheck: dict | None) -> str:
    """The re-check's measurable changes, in words ("" when there are none)."""
    hits = [r for r in (recheck or {}).get("rows", []) if r.get("measurable")]
    if not hits:
        return ""
    return (f" Re-checked on {recheck['gpus']} x {recheck['card']}: "
            + "; ".join(f"`{r['change']}` changed tokens/s/GPU by {r['effect_pct']:+.1f}% "
                        "(intervals apart)" for r in hits) + ".")


def _missing_on_more_gpus(rep: dict, recheck: dict | None) -> str:
    """What is not measured on a larger host: everything until a re-check
    (`trainplan.tune.recheck`) is committed, then the changes it did not run."""
    if recheck is None:
        return (f"**The top knobs on more GPUs.** The study ran on {rep['gpus']} GPUs; "
                "its top knobs are still to be measured again on a larger host.")
    if rep["gpus"] >= recheck["gpus"]:  # the re-check was of an earlier, smaller study
        fams = (rep.get("effects") or {}).get("families", {})
        fewer = [f"{f} ({d['where']['gpus']} GPUs)" for f, d in fams.items()
                 if (d.get("where") or {}).get("gpus", rep["gpus"]) < rep["gpus"]]
        return (f"**Paired effects on {rep['gpus']} GPUs for every family.** The search ran on "
                f"{rep['gpus']} x {rep['card']}; "
                + (f"the paired effects of {', '.join(fewer)} were measured on fewer GPUs "
                   "only." if fewer else "so did every family's paired effects.")
                + " Other networks (InfiniBand or RoCE between nodes) can differ.")
    skipped = [f"`{r['change']}`" for r in recheck["rows"] if not r["launches"]]
    return (f"**The rest of the re-check.** The study's best was re-checked on "
            f"{recheck['gpus']} x {recheck['card']} one knob at a time (above). "
            + (f"Not run there: {', '.join(skipped)}. " if skipped else "")
            + "The NCCL settings were not re-checked: the study found no measurable effect "
              "for them on two GPUs, and larger hosts and other networks can differ.")


def _in_level(value: int, level: str) -> bool:
    """Whether `value` falls in a knob level as the report writes it ("4", "1-2", "3-8")."""
    lo, _, hi = str(level).partition("-")
    try:
        return int(lo) <= value <= int(hi or lo)
    except ValueError:
        return False


def plan_against_recipe(rep: dict | None, micro_batch: int, model: str) -> str:
    """Where a scenario's plan runs a micro-batch in a range the study says to avoid, why the
    advice does not carry over (markdown); "" otherwise. The study timed its own job, whose
    memory leaves room for larger micro-batches; the planner priced every micro-batch that
    fits the scenario's memory and chose the fastest. Where the paired stage has run, it
    judges micro-batch, and this says nothing."""
    paired = _paired_knobs(rep)
    knobs = {k["knob"]: k for k in (rep or {}).get("knobs", []) if k["knob"] not in paired}
    for e in knobs.get("micro_batch", {}).get("effects", []):
        if e["ci_pct"][1] < 0 and _in_level(micro_batch, e["level"]):
            return (f"The plan's micro-batch {micro_batch} ({model}) is in that range: the "
                    f"study's `{rep['model']}` had memory to spare, the plan takes the fastest "
                    "micro-batch that fits (page 2, Memory budget).")
    return ""
