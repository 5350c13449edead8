"""Page 4's plain-words sentences that depend on which records exist (markdown), and the
headline figures that page 4 and its appendix (validation in detail) glue alike."""

from __future__ import annotations

import statistics

from trainplan.specs import SLICE


def hosts_list(hosts: dict) -> str:
    """'4 x NVIDIA H200 (3 configurations) and 2 x NVIDIA H200 (10)' from `compare`'s hosts."""
    parts = [f"{h} ({v['configs']} configuration{'s' if v['configs'] != 1 else ''})"
             if i == 0 else f"{h} ({v['configs']})" for i, (h, v) in enumerate(hosts.items())]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def worst_config(rows: list[dict], key: str) -> str:
    """The config among `rows` whose `key` error ("step_time" or "memory") is largest."""
    return max(rows, key=lambda r: abs(r[f"{key}_error"]))["config"]


def headline_values(out: dict, split: dict) -> dict:
    """The headline of a comparison (`compare.compare`, split by `views.split_rows`) to glue:
    median and worst |error| of step time and peak memory over every host and on the headline
    host, the configs behind the worst, counts, the hosts in words, and the model whose layers
    the width check slices (`slice_base`, None without slices)."""
    rows, head, head_rows = split["rows"], split["head"], split["head_rows"]
    every, host = out["all_hosts"], out["hosts"][head]
    return {
        "n_configs": every["configs"], "n_refused": len(out["refused"]),
        "n_superseded": out["superseded"], "n_flagged": out["flagged_configs"],
        "step_median": every["step_time_error"]["median"],
        "step_max": every["step_time_error"]["max"],
        "mem_median": every["memory_error"]["median"], "mem_max": every["memory_error"]["max"],
        "step_worst": worst_config(rows, "step_time"), "mem_worst": worst_config(rows, "memory"),
        "n_optimistic": sum(r["step_time_error"] < 0 for r in rows),
        "proxy_model": rows[0]["model"], "headline_host": head, "head_configs": len(head_rows),
        "head_step_median": host["step_time_error"]["median"],
        "head_step_max": host["step_time_error"]["max"],
        "head_mem_median": host["memory_error"]["median"],
        "head_mem_max": host["memory_error"]["max"],
        "head_step_worst": worst_config(head_rows, "step_time"),
        "head_mem_worst": worst_config(head_rows, "memory"),
        "hosts_list": hosts_list(out["hosts"]),
        "n_launches": sum(r["launches"] for r in split["current"]),
        "slice_base": SLICE.fullmatch(split["sliced"][0]["model"])["base"]
        if split["sliced"] else None,
    }


def not_measured_note(out: dict, target_slice: str = "llama-13b", traced: bool = False) -> str:
    """What the records do not cover yet, in the order a reader needs it (`traced`: a
    profiler trace is committed, `trace_split.committed()`)."""
    items = []
    waiting = out["predicted_not_measured"]
    if waiting:
        items.append(f"predicted but not yet measured: {', '.join(waiting)} (the device time "
                     "ran out before they started; their predictions stay on record)")
    if not any(r["model"].startswith(f"{target_slice}:") for r in out["rows"]):
        items.append(f"the layer slice of {target_slice} at its real width, on which the "
                     "extrapolation from the proxy to the full model should rest")
    if not traced:
        items.append("a profiler trace of one config, so the split of each measured step into "
                     "its terms is the planner's, not the run's")
    if not items:
        return "nothing the page relies on."
    return "; ".join(items[:-1]) + (", and " if len(items) > 1 else "") + items[-1] + "."


def failed_note(failed: list[dict]) -> str:
    """Launches that ended without a measurement (`compare`'s "failed"), in words: a config
    the planner said fits and that ran out of memory is a memory miss of at least the bound
    PyTorch's message gives (`compare_failed`)."""
    if not failed:
        return "No launch of a measured config failed."
    said = []
    for f in failed:
        where = f"{f['config']} on {f['host']}"
        if f["out_of_memory"] and f["memory_error_at_most"] is not None:
            fits = "would fit" if f["predicted_fits"] else "would not fit"
            said.append(f"{where} ran out of memory where the planner predicted "
                        f"{f['predicted_memory_gib']:.2f} GiB and said it {fits}; it needed at "
                        f"least {f['needed_gib']:.2f} GiB, memory under-predicted by "
                        f"{-f['memory_error_at_most']:.1%} or more")
        else:
            said.append(f"{where} failed ({f['reason'][:80]})")
    lead = "One launch failed" if len(failed) == 1 else f"{len(failed)} configs' launches failed"
    return f"{lead}, listed here rather than dropped: " + "; ".join(said) + "."


def repredicted_step_error(row: dict) -> float | None:
    """A compared row's step-time error re-predicted now with the calibrated constants
    (predicted over measured minus one), or None where the row has no re-prediction."""
    cal = (row.get("repredicted") or {}).get("calibrated") or {}
    if cal.get("step_time_s") is None:
        return None
    return cal["step_time_s"] / row["measured_step_time_s"] - 1.0


def worst_repredicted(rows: list[dict], keep) -> dict | None:
    """{"config", "error", "direction"} of the row among those `keep(row)` accepts whose
    re-predicted step time misses most, or None where none is re-predicted; "direction" says
    in words which way it misses."""
    found = [(r["config"], repredicted_step_error(r)) for r in rows if keep(r)]
    found = [(c, e) for c, e in found if e is not None]
    if not found:
        return None
    config, error = max(found, key=lambda ce: abs(ce[1]))
    way = "faster" if error < 0 else "slower"  # a shorter predicted step: faster than it ran
    return {"config": config, "error": error, "direction": f"predicted {way} than it ran"}


def per_layer_values(pairs: list[dict]) -> dict:
    """Page 4's figures of one target layer (`compare_views.per_layer`) to glue: pairs, the
    median |step error|, the worst step and memory pairs with their errors, the most
    reserved beyond allocated a layer; raises ValueError where no pair exists."""
    if not pairs:
        raise ValueError("no slice pairs of two depths: page 4's per-layer section needs them")

    def name(p):
        return f"{p['to']} less {p['from']}"

    step = max(pairs, key=lambda p: abs(p["step_time_error"]))
    mem = min(pairs, key=lambda p: p["memory_error"])
    reserve = [p["measured_reserve_gib"] for p in pairs if p["measured_reserve_gib"] is not None]
    return {"layer_pairs": len(pairs),
            "layer_step_median": statistics.median(abs(p["step_time_error"]) for p in pairs),
            "layer_step_worst": name(step), "layer_step_worst_error": step["step_time_error"],
            "layer_step_worst_now": step.get("repredicted_step_error"),
            "layer_mem_worst": name(mem), "layer_mem_worst_error": mem["memory_error"],
            "layer_reserve_max": max(reserve) if reserve else None,
            "layer_reserve_min": min(reserve) if reserve else None}
