"""The effects stage's pairs: a base and a variant run back to back on the same GPUs, in an
order drawn from a seeded RNG (`order`) and recorded, and their records.

Two ways to run them:

- `run_pair`: one pair, two launches. The NCCL knobs need it: NCCL reads NCCL_ALGO and
  NCCL_PROTO when it makes a communicator, and the harness's device mesh uses the launch's
  default process group, made once at its start.
- `run_round`: several pairs in one sweep launch (`trainplan.bench.series.sweep`), each
  pair's two runs next to each other, for the knobs one process can change from run to run
  (loader workers and prefetch, accumulation, micro-batch, packing), and with pairing
  "sweep-nccl" the NCCL knobs too: every run then carries its NCCL_* and makes its process
  groups anew under them (tensor parallel too: `bench.series.sweep.settle`). The launch's start
  (torchrun, imports, process group) is paid once a round instead of twice a pair; on a GPU
  a sweep's runs time as separate launches do (`data/measurements/sweep-ab-h200x2-20261128/`).

Records, appended to `STEM-effects.jsonl` one line a write (a kill leaves a line whole or
absent): for each attempt exactly one `pair`, `failed` or `interrupted`, numbered in order.
A pair's `launch` says how it ran; a round's pairs carry `round` (its first attempt, its
pairs, the launch's start in GPU-seconds) and each run's GPU-seconds, from which the stage
prices the next round. The spend of the launch under way is rewritten every heartbeat to
`STEM-effects.inflight.json`; `recover` turns a killed call's into `interrupted` records, so
what it spent stays counted.
"""

from __future__ import annotations

import functools
import json
import os
import time
import zlib
from pathlib import Path

import numpy as np

from trainplan.loader import load_json
from trainplan.records.provenance import git_commit
from trainplan.tune import knobs
from trainplan.tune import study as tn
from trainplan.tune import trial as tl
from trainplan.tune.effect_stats import TERMINAL, read_records


@functools.lru_cache(maxsize=1)
def _commit() -> str | None:
    return git_commit()


def append(path: Path, record: dict) -> None:
    """Append one record as one line, in one write (a kill leaves it whole or absent), with
    its time and the code's commit (`provenance.git_commit`, as measurement records carry)."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = json.dumps({"kind": "knob effect", **record, "at": at, "recorded_at": at,
                       "provenance": {"git_commit": _commit()}})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _inflight(path: Path, fields: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(fields))
    os.replace(tmp, path)


def recover(records_path: Path, live: Path) -> int:
    """Turn a killed call's in-flight spend into `interrupted` records, one for each attempt
    of the killed launch whose own record was not written before the kill, the spend not
    yet on record on the first of them; the number written, 0 when nothing was in flight."""
    if not live.is_file():
        return 0
    fields = load_json(live, error=tn.StudyError)
    each = {i["attempt"]: i for i in fields.pop("idents", None) or [fields]}
    attempts = list(each)
    done = {r["attempt"]: r for r in read_records(records_path)
            if r.get("design") == fields["design"] and r.get("study") == fields["study"]
            and r["record"] in TERMINAL and r.get("attempt") in attempts}
    todo = [a for a in attempts if a not in done]
    left = max(0.0, float(fields["gpu_seconds"]) - sum(float(r.get("gpu_seconds", 0.0))
                                                       for r in done.values()))
    for i, a in enumerate(todo):
        append(records_path, {"record": "interrupted", **fields, **each[a],
                              "gpu_seconds": left if i == 0 else 0.0,
                              "why": "the call was killed"})
    live.unlink()
    return len(todo)


def order(seed: int, design_name: str, attempt: int) -> list[str]:
    """Which of the pair runs first: a coin from a RNG seeded by the study's seed, the design
    and the attempt number, so a resumed call draws what an unbroken one would have."""
    rng = np.random.default_rng([seed, zlib.crc32(design_name.encode()), attempt])
    return ["base", "variant"] if rng.random() < 0.5 else ["variant", "base"]


def _ident(run, variant: dict, attempt: int) -> dict:
    head = run["head"]
    return {"study": run["name"], "design": head["design"], "card": run["card"],
            "attempt": attempt,
            "variant": variant["id"], "knob": variant["knob"], "value": variant["value"],
            "order": order(head["seed"], head["design"], attempt)}


def _spent(run, records) -> float:
    return run["search_s"] + sum(float(r.get("gpu_seconds", 0.0)) for r in records
                                 if r.get("study") == run["name"])


def _ticker(run, live_fields: dict, spent: float, used: float):
    """The heartbeat of a launch: rewrite the in-flight spend, say why to stop (or None)."""
    gpus = run["suite"]["gpus"]

    def tick(elapsed):
        cost = used + elapsed * gpus
        _inflight(run["live"], {**live_fields, "gpu_seconds": cost})
        if spent + cost > run["budget_s"]:
            return "budget"
        stop = run["stop_after_s"]
        return "time" if stop and time.monotonic() - run["start"] > stop else None
    return tick


def _run_id(run, attempt: int, side: str) -> str:
    return f"{run['name']}/effects-{run['head']['design']}/attempt-{attempt}/{side}"


def _config(run, variant: dict, side: str) -> dict:
    return run["head"]["base"] if side == "base" else variant["config"]


def run_pair(run, variant: dict, attempt: int, records) -> str:
    """Run one pair as two launches and append its record; 'ok', 'failed', 'budget' or
    'time'."""
    suite, gpus = run["suite"], run["suite"]["gpus"]
    spent, ident = _spent(run, records), _ident(run, variant, attempt)
    runs, costs, used = {}, [], 0.0
    for position, side in enumerate(ident["order"]):
        cfg = _config(run, variant, side)
        env = tl.launch_env(cfg)
        if run["devices"] is not None:
            env["CUDA_VISIBLE_DEVICES"] = run["devices"]
        cmd = tl.launch_command(suite, cfg, run["cpu"])
        if not run["cpu"]:
            cmd += ["--records", str(run["rec_path"]), "--run-id", _run_id(run, attempt, side)]
        _inflight(run["live"], {**ident, "gpu_seconds": used})
        summary, error, seconds = tl.run_launch(cmd, env, tick=_ticker(run, ident, spent, used),
                                                deadline_s=suite["launch_timeout_s"])
        used += seconds * gpus
        costs.append(seconds * gpus)
        if summary is None:
            why = tl.stop_reason(error)
            kind = "interrupted" if why in ("budget", "time") else "failed"
            append(run["rec"], {"record": kind, **ident, "side": side, "error": error,
                                "launch": "separate", "gpu_seconds": used,
                                "launch_gpu_seconds": costs})
            run["live"].unlink(missing_ok=True)
            return why if kind == "interrupted" else "failed"
        runs[side] = _figure(summary, seconds, position)
    append(run["rec"], {"record": "pair", **ident, **_ratio(runs), "launch": "separate",
                        "gpu_seconds": used, "launch_gpu_seconds": costs})
    run["live"].unlink(missing_ok=True)
    return "ok"


def _figure(summary: dict, seconds: float, position: int) -> dict:
    fig = tl.pooled([summary])
    return {"tokens_per_s_per_gpu": fig["tokens_per_s_per_gpu"], "ci": fig["ci"],
            "seconds": round(seconds, 3), "position": position}


def _ratio(runs: dict) -> dict:
    return {"base_run": runs["base"], "variant_run": runs["variant"],
            "log_ratio": float(np.log(runs["variant"]["tokens_per_s_per_gpu"]
                                      / runs["base"]["tokens_per_s_per_gpu"]))}


def run_round(run, variants: list[dict], first: int, records) -> list[str]:
    """Run one pair of each of `variants` (attempts first, first + 1, ...) in one sweep
    launch and append their records; each pair's outcome, as `run_pair`'s."""
    suite, gpus, k = run["suite"], run["suite"]["gpus"], len(variants)
    spent = _spent(run, records)
    idents = [_ident(run, v, first + i) for i, v in enumerate(variants)]
    entries, own_env = [], run["pairing"] == "sweep-nccl"
    for v, ident in zip(variants, idents, strict=True):
        for side in ident["order"]:
            cfg = _config(run, v, side)
            args = tl.train_args(suite, cfg, run["cpu"])
            if not run["cpu"]:
                args += ["--records", str(run["rec_path"]), "--run-id",
                         _run_id(run, ident["attempt"], side)]
            entries.append({"tag": f"{ident['attempt']}/{side}", "args": args,
                            **({"env": knobs.env(cfg)} if own_env else {})})
    env = tl.launch_env(run["head"]["base"])  # the launch's: the base's NCCL knobs
    if run["devices"] is not None:
        env["CUDA_VISIBLE_DEVICES"] = run["devices"]
    live = {**idents[0], "idents": idents, "launch": "sweep"}
    _inflight(run["live"], {**live, "gpu_seconds": 0.0})
    by_tag, start, error, _ = tl.sweep_launch(suite, entries, env,
                                              tick=_ticker(run, live, spent, 0.0))
    why = tl.stop_reason(error)
    outcomes, crashed = [], False
    for ident in idents:
        mine = [by_tag.get(f"{ident['attempt']}/{side}") for side in ident["order"]]
        run_costs = [float(ln["elapsed_s"]) * gpus if ln else 0.0 for ln in mine]
        common = {**ident, "launch": "sweep", "gpu_seconds": start / k + sum(run_costs),
                  "run_gpu_seconds": run_costs,
                  "round": {"first_attempt": first, "pairs": k, "start_gpu_seconds": start}}
        bad = next((ln for ln in mine if ln and "error" in ln), None)
        if all(ln and "summary" in ln for ln in mine):
            figs = {side: _figure(ln["summary"], float(ln["elapsed_s"]), position)
                    for position, (side, ln) in enumerate(zip(ident["order"], mine, strict=True))}
            append(run["rec"], {"record": "pair", **common, **_ratio(figs)})
            outcomes.append("ok")
        elif bad is not None or (not why and not crashed):
            side = ident["order"][mine.index(bad)] if bad else \
                ident["order"][[ln is None for ln in mine].index(True)]
            append(run["rec"], {"record": "failed", **common, "side": side,
                                "error": bad["error"] if bad else error})
            outcomes.append("failed")
            crashed = crashed or bad is None  # the launch died in this pair: the rest wait
        else:
            append(run["rec"], {"record": "interrupted", **common, "error": error or
                                "the sweep launch ended before this pair ran"})
            outcomes.append(why or "interrupted")
    run["live"].unlink(missing_ok=True)
    return outcomes
