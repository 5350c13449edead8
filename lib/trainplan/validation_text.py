"""Page 4's plain-words sentences that depend on which records exist (markdown)."""

from __future__ import annotations


def hosts_list(hosts: dict) -> str:
    """'4 x NVIDIA H200 (3 configurations) and 2 x NVIDIA H200 (10)' from `compare`'s hosts."""
    parts = [f"{h} ({v['configs']} configuration{'s' if v['configs'] != 1 else ''})"
             if i == 0 else f"{h} ({v['configs']})" for i, (h, v) in enumerate(hosts.items())]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def not_measured_note(out: dict, target_slice: str = "llama-13b") -> str:
    """What the records do not cover yet, in the order a reader needs it."""
    items = []
    waiting = out["predicted_not_measured"]
    if waiting:
        items.append(f"predicted but not yet measured: {', '.join(waiting)} (the device time "
                     "ran out before they started; their predictions stay on record)")
    if not any(r["model"].startswith(f"{target_slice}:") for r in out["rows"]):
        items.append(f"the layer slice of {target_slice} at its real width, on which the "
                     "extrapolation from the proxy to the full model should rest")
    items.append("a profiler trace of one config, so the split of each measured step into its "
                 "terms below is the planner's, not the run's")
    return "; ".join(items[:-1]) + (", and " if len(items) > 1 else "") + items[-1] + "."
