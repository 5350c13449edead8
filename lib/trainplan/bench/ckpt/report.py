"""The checkpoint benchmark's numbers: state size, fingerprint, its record and its table.

`record` turns one `ckpt_bench` launch into a `checkpoint` record
(`trainplan.records.schema`): the raw write test, every save (mode, stall, wait for
the previous save, persist time, bytes, persist throughput), the step times,
the restart, and a `summary` of medians that the page-5 figures read:

- stall: the training loop blocked by a save, slowest rank; for an
  asynchronous save, the staging of its CPU copy plus rank 0's commit when
  it lands between steps (`wait_prev_s`, waiting for the previous save, is
  kept apart: it says the interval is shorter than the persist time). The
  asynchronous median leaves out the run's first save, which also allocates
  the pinned CPU copy that later saves reuse (`async_first_stall_s`);
- persist_gbps = checkpoint bytes / persist_s (start of the save until the
  manifest is renamed: every shard written, fsynced and hashed), against
  raw_write_gbps of the same disk in the same launch.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import torch

from trainplan.bench.ckpt.store import EVENTS
from trainplan.records import schema as records

MODES = ("sync", "async")
_VERDICT = {True: "matches", False: "DIFFERS", None: "not compared (last save failed)"}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _tensors(par, optimizer):
    for name, p in sorted(((n, p) for part in par.parts for n, p in part.named_parameters())):
        yield name, _local(p.detach())
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    yield f"{i}.{j}.{key}", _local(value)


def state_bytes(par, optimizer, reduce) -> float:
    """Bytes of model and optimizer tensors over all ranks (`reduce` sums a list)."""
    import torch.distributed as dist

    mine = float(sum(t.numel() * t.element_size() for _, t in _tensors(par, optimizer)))
    return reduce([mine], dist.ReduceOp.SUM)[0] if dist.is_initialized() else mine


def fingerprint(par, optimizer) -> str:
    """sha256 of this rank's model and optimizer shards (equal before a save and after
    its load on the same layout)."""
    h = hashlib.sha256()
    for name, t in _tensors(par, optimizer):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def events(root: Path, kind: str) -> list[dict]:
    """Events of one kind from the run's events.jsonl (rank 0's and any rank's)."""
    path = Path(root) / EVENTS
    if not path.is_file():
        return []
    lines = (json.loads(x) for x in path.read_text().splitlines() if x.strip())
    return [e for e in lines if e.get("event") == kind]


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(raw: dict, saves: list[dict], steps: list[dict], restart: dict) -> dict:
    """Medians over the committed saves of each mode (a failed save is listed in the
    record's `saves`, not summarised)."""
    saves = [s for s in saves if s["committed"]]

    def of(mode, key):
        return _median(s[key] for s in saves if s["mode"] == mode)

    out = {"raw_write_gbps": raw["gbps"],
           "checkpoint_bytes": _median(s["bytes"] for s in saves),
           "restart_to_first_step_s": restart["restart_to_first_step_s"],
           "async_wait_prev_max_s": max((s["wait_prev_s"] for s in saves
                                         if s["mode"] == "async"), default=None),
           "step_time_s": _median(s["time_s"] for s in steps
                                  if s["mode"] in MODES and not s["writing"]),
           "step_time_writing_s": _median(s["time_s"] for s in steps if s["writing"])}
    for mode in MODES:
        stalls = [s["stall_s"] + s["commit_in_loop_s"] for s in saves if s["mode"] == mode]
        # the first asynchronous save also allocates the reused pinned CPU copy (once a run)
        out[f"{mode}_first_stall_s"] = stalls[0] if stalls else None
        out[f"{mode}_stall_s"] = _median(stalls[1:] if mode == "async" and len(stalls) > 1
                                         else stalls)
        out[f"persist_s_{mode}"] = of(mode, "persist_s")
        out[f"persist_gbps_{mode}"] = of(mode, "persist_gbps")
        gbps = out[f"persist_gbps_{mode}"]
        out[f"persist_vs_raw_{mode}"] = gbps / raw["gbps"] if gbps and raw["gbps"] else None
    return out


def record(bench, targs, b, *, raw: dict, restart: dict, async_options, state_bytes: float
           ) -> dict:
    """The `checkpoint` record of one launch (rank 0; `b` is the finished `ckpt_bench.Bench`)."""
    saved = {e["step"]: e for e in events(b.root, "saved")}
    saves = []
    for s in b.saves:
        e = saved.get(s["step"], {})
        persist, size = e.get("persist_s"), e.get("bytes")
        saves.append({**s, "persist_s": persist, "bytes": size,
                      "persist_gbps": size / persist / 1e9 if persist and size else None,
                      "committed": bool(e)})
    cuda = b.device.type == "cuda"
    cfg = b.cfg
    rec = {
        "kind": "checkpoint", "recorded_at": records.utc_now(),
        "model": targs.model if not targs.layers else f"{targs.model}:{targs.layers}-layers",
        "layout": {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep,
                   "zero": cfg.zero, "dp_shard": cfg.dp_shard, "micro_batch": cfg.micro_batch,
                   "grad_accum": cfg.grad_accum, "recompute": cfg.recompute,
                   "compile": targs.compile},
        "ranks": b.world, "device": b.device.type,
        "card": torch.cuda.get_device_name(b.device) if cuda else "cpu",
        "run_id": bench.run_id or "adhoc", "seq_len": targs.seq_len,
        "synthetic": targs.synthetic, "ckpt_root": str(Path(bench.ckpt_root).resolve()),
        "every": bench.every, "steps_per_mode": bench.steps_per_mode, "keep": bench.keep,
        "writer": {"threads": targs.ckpt_threads, "hash": targs.ckpt_hash},
        "state_bytes": state_bytes, "raw_write": raw, "saves": saves, "steps": b.steps,
        "restart": restart, "async_options": async_options or {},
        "summary": summarise(raw, saves, b.steps, restart),
        "provenance": records.provenance(),
    }
    return records.validate(records.plain(rec))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rec: dict) -> str:
    """The launch in a few lines, for the end of the log."""
    s, r = rec["summary"], rec["restart"]
    size = s["checkpoint_bytes"] or 0
    size = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
    lines = [f"checkpoint benchmark: {rec['model']} dp{rec['layout']['dp']} "
             f"zero{rec['layout']['zero']} on {rec['ranks']} x {rec['card']}; "
             f"{size} a save; disk {rec['ckpt_root']}",
             f"raw write (fsync, {rec['raw_write']['writers']} writers): "
             f"{s['raw_write_gbps']:.2f} GB/s",
             f"{'':28}{'sync':>10}{'async':>10}"]
    for label, key, spec in (("stall per save (s)", "{}_stall_s", ".3f"),
                             ("persist (s)", "persist_s_{}", ".2f"),
                             ("persist (GB/s)", "persist_gbps_{}", ".2f"),
                             ("persist / raw write", "persist_vs_raw_{}", ".0%")):
        cells = "".join(f"{_fmt(s.get(key.format(m)), spec):>10}" for m in MODES)
        lines.append(f"{label:28}{cells}")
    lines.append(f"first async save (allocates the pinned copy): "
                 f"{_fmt(s['async_first_stall_s'], '.2f')} s stall")
    lines.append(f"async: waited for the previous save up to "
                 f"{_fmt(s['async_wait_prev_max_s'], '.2f')} s; step "
                 f"{_fmt(s['step_time_s'], '.3f')} s idle, "
                 f"{_fmt(s['step_time_writing_s'], '.3f')} s while writing")
    last = next((x for x in reversed(rec["saves"]) if x["mode"] == "async" and x.get("phases")),
                None)
    if last:
        ph = last["phases"]
        lines.append("last async save's stall: " + ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {_fmt(ph.get(k), '.2f')}"
            for k in ("prepare_s", "state_dict_s", "stage_s", "async_call_s"))
            + f" s; then writing {_fmt(ph.get('write_s'), '.2f')}, hashing after it "
            f"{_fmt(ph.get('hash_s'), '.2f')} s")
    lines.append(f"restart to first step ({r['how'].split(':')[0]}): "
                 f"{r['restart_to_first_step_s']:.2f} s (build + load "
                 f"{r['build_and_load_s']:.2f}, load {_fmt(r['load_s'], '.2f')}, first step "
                 f"{r['first_step_s']:.2f}); process start to process group "
                 f"{r['cold_start_s']:.1f} s; state after load "
                 f"{_VERDICT[r['state_matches']]}")
    failed = [str(x["step"]) for x in rec["saves"] if not x["committed"]]
    if failed:
        lines.insert(-1, f"FAILED saves (steps {', '.join(failed)}): see events.jsonl")
    return "\n".join(lines)
