"""Configs whose launches ended without a measurement, listed beside the comparison.

A config that ran out of memory has no step time or peak to compare, but dropping it would
flatter the planner where it said the config fits. Each `failed_launch` record
(`bench.suite.record_failure`) is paired, like a measurement, with the latest prediction
of its config recorded before it (`compare.pick_prediction`'s rule). Where PyTorch's
out-of-memory message says what the process held and what it asked for, their sum is a
floor under the peak the config needed, so

    memory error <= predicted / (held + asked) - 1

is a bound on the memory error (the true error is at least this far below zero).
"""

from __future__ import annotations

import re
from collections import defaultdict

from trainplan.compare.matching import host, pick_prediction, stamp

HELD = re.compile(r"this process has ([0-9.]+) GiB")
ASKED = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB)")


def needed_gib(reason: str) -> float | None:
    """GiB the failed launch needed at least (held + asked), from an out-of-memory reason."""
    held, asked = HELD.search(reason), ASKED.search(reason)
    if not held or not asked:
        return None
    return float(held[1]) + float(asked[1]) / (1024.0 if asked[2] == "MiB" else 1.0)


def failed_rows(failures: list[dict], predictions: list[dict]) -> list[dict]:
    """One row per config and host whose launches failed, in order of first failure:
    {"config", "model", "gpus", "card", "host", "launches_failed", "failed_at", "reason",
    "out_of_memory", "predicted_at", "predicted_fits", "predicted_memory_gib",
    "needed_gib", "memory_error_at_most"} (None where unknown)."""
    groups = defaultdict(list)
    for f in failures:
        groups[(f["tag"], host(f), f["model"], f["gpus"])].append({**f, "impl": "trainplan"})
    rows = []
    for launches in sorted(groups.values(), key=lambda g: min(stamp(f) for f in g)):
        launches.sort(key=stamp)
        first = launches[0]
        pred, _ = pick_prediction(launches, predictions)
        p = (pred or {}).get("predicted") or {}
        p_mem = (p.get("memory_gib") or {}).get("total")
        need = needed_gib(first["reason"])
        rows.append({
            "config": first["tag"], "model": first["model"], "gpus": first["gpus"],
            "card": first["card"], "host": host(first), "launches_failed": len(launches),
            "failed_at": first["recorded_at"], "reason": first["reason"],
            "out_of_memory": "out of memory" in first["reason"].lower(),
            "predicted_at": (pred or {}).get("recorded_at"), "predicted_fits": p.get("fits"),
            "predicted_memory_gib": p_mem, "needed_gib": need,
            "memory_error_at_most": None if p_mem is None or not need else p_mem / need - 1.0})
    return rows
