"""A measurement series: predict every config first, then measure each in separate launches.

    PYTHONPATH=lib python -m trainplan.bench.suite data/suites/NAME.yaml --out DIR \
        [--launches 3] [--only TAG ...] [--budget-s 540]

1. Predictions: for every config of the suite, the planner prices exactly that
   layout (`trainplan.plan.plan`, every dimension pinned: the `trainplan plan`
   code path) and a prediction record is appended to DIR/predictions.jsonl,
   stamped before any measurement of the series starts (DESIGN.md, "Honest
   measurement").
2. Measurements: each config is launched `--launches` times, each a fresh
   `torchrun` of `trainplan.bench.train` appending a measurement record to
   DIR/measurements.jsonl; configs run in the suite's order, all launches of
   one before the next, so that a budget cut leaves whole configs.
3. A short table (predicted vs measured step time, tokens/s/GPU, MFU, memory).

NVLink multicast stays off in every launch (NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from trainplan import records
from trainplan.errors import SpecError, TrainplanError

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
LAYOUT_FLAGS = ("dp", "tp", "pp", "zero", "dp_shard", "micro_batch", "grad_accum", "recompute",
                "pp_schedule", "pp_virtual")
CARD_PRESETS = {"H200": "h200-sxm", "H100": "h100-sxm", "A100": "a100-80gb"}
IMPL_MODULES = {"trainplan": "trainplan.bench.train",  # a config's `impl:` -> what it launches
                "hf-baseline": "trainplan.bench.hf_baseline"}


def load_suite(path: str) -> dict:
    try:
        suite = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"suite {path}: cannot read ({' '.join(str(err).split())[:200]})") from None
    if not isinstance(suite, dict) or not isinstance(suite.get("configs"), list):
        raise SpecError(f"suite {path}: expected a mapping with a 'configs' list")
    for c in suite["configs"]:
        unknown = set(c.get("layout", {})) - set(LAYOUT_FLAGS) - {"cp", "ep"}
        if "tag" not in c or "gpus" not in c or unknown:
            raise SpecError(f"suite {path}: config {c!r} needs 'tag' and 'gpus'; "
                            f"layout keys are {list(LAYOUT_FLAGS)}")
        if c.get("impl", "trainplan") not in IMPL_MODULES:
            raise SpecError(f"suite {path}: config {c['tag']!r} has impl = {c['impl']!r}; "
                            f"use one of {list(IMPL_MODULES)}")
    return suite


def card_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_preset(card: str, suite: dict) -> str:
    for key, preset in CARD_PRESETS.items():
        if key in card:
            return preset
    return suite.get("gpu", "h100-sxm")


def full_layout(cfg: dict) -> dict:
    """The config's layout with every field the planner pins (ParallelConfig's defaults)."""
    lay = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "micro_batch": 1,
           "grad_accum": 1, "recompute": "none", "pp_schedule": "1f1b", "pp_virtual": 1}
    lay.update(cfg.get("layout", {}))
    lay.setdefault("dp_shard", lay["dp"] if lay["zero"] else 1)
    return lay


def predict(suite: dict, cfg: dict, card: str, run_id: str) -> dict:
    """The planner's figures for exactly this layout, as a prediction record."""
    from trainplan.plan import plan
    from trainplan.specs import load_cluster, load_gpu, load_model

    lay = full_layout(cfg)
    seq = suite.get("seq_len", 2048)
    gpu = load_gpu(gpu_preset(card, suite))
    tokens = lay["dp"] * lay["micro_batch"] * lay["grad_accum"] * seq
    out = plan(load_model(suite["model"]), gpu, load_cluster(suite.get("cluster", "dgx-h100")),
               gpus=cfg["gpus"], seq_len=seq, global_batch_tokens=tokens, pins=lay)
    p = out["plans"][0]
    predicted = {k: p[k] for k in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "fits")}
    predicted["memory_gib"] = p["memory_gib"]
    predicted["time_breakdown_s"] = p["time_breakdown_s"]
    layout = {**{k: lay[k] for k in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch",
                                     "grad_accum", "recompute")},
              "compile": bool(cfg.get("compile", False))}
    return records.prediction_record(
        model=suite["model"], layout=layout, gpus=cfg["gpus"], card=card, predicted=predicted,
        config={"tag": cfg["tag"], "gpu_preset": gpu.name, "seq_len": seq, "full_layout": lay,
                "impl": cfg.get("impl", "trainplan")},
        run_id=run_id)


def train_command(suite: dict, cfg: dict, out: Path, run_id: str) -> list[str]:
    lay = full_layout(cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cfg['gpus']}", "-m", IMPL_MODULES[cfg.get("impl", "trainplan")],
           "--model", suite["model"], "--seq-len", str(suite.get("seq_len", 2048)),
           "--steps", str(cfg.get("steps", suite.get("steps", 12))),
           "--warmup", str(cfg.get("warmup", suite.get("warmup", 4))),
           "--records", str(out / "measurements.jsonl"), "--run-id", run_id, "--json"]
    for k in LAYOUT_FLAGS:
        cmd += [f"--{k.replace('_', '-')}", str(lay[k])]
    if cfg.get("compile"):
        cmd.append("--compile")
    cmd += [str(a) for a in cfg.get("extra_args", suite.get("extra_args", []))]
    return cmd


def run_suite(path: str, out: Path, launches: int, only: list[str], budget_s: float) -> list:
    suite = load_suite(path)
    configs = [c for c in suite["configs"] if not only or c["tag"] in only]
    out.mkdir(parents=True, exist_ok=True)
    card = card_name()
    run_id = f"{Path(path).stem}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    preds = {}
    for cfg in configs:  # every prediction is on disk before the first launch
        preds[cfg["tag"]] = predict(suite, cfg, card, run_id)
        records.append(out / "predictions.jsonl", preds[cfg["tag"]])
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    start, rows = time.monotonic(), []
    for i, cfg in enumerate(configs, 1):
        done, first = [], None
        for launch in range(launches):
            spent = time.monotonic() - start
            if first is not None and spent + first * (launches - launch) > budget_s:
                break
            if first is None and spent > budget_s * 0.9:
                break
            t0 = time.monotonic()
            proc = subprocess.run(train_command(suite, cfg, out, run_id), env=env,
                                  capture_output=True, text=True)
            first = first or time.monotonic() - t0
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                print(f"[{i}/{len(configs)}] {cfg['tag']} launch {launch + 1}: FAILED "
                      f"rc={proc.returncode} {' | '.join(tail)}", flush=True)
                break
            done.append(json.loads(lines[-1]))
            s = done[-1]
            print(f"[{i}/{len(configs)}] {cfg['tag']} launch {launch + 1}/{launches}: "
                  f"{s.get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        rows.append((cfg["tag"], preds[cfg["tag"]]["predicted"], done))
    return rows


def print_table(rows) -> None:
    print(f"{'config':<24}{'n':>2}{'pred s':>9}{'meas s':>9}{'err':>7}{'tok/s/GPU':>11}"
          f"{'MFU':>7}{'pred GiB':>9}{'rsv GiB':>9}")
    for tag, pred, done in rows:
        if not done:
            print(f"{tag:<24} 0  (not measured)")
            continue
        step = sorted(s["step_time_s"] for s in done)[len(done) // 2]
        rate = sorted(s["tokens_per_s_per_gpu"] for s in done)[len(done) // 2]
        mfu = sorted(s["mfu"] for s in done)[len(done) // 2]
        rsv = max(s["peak_mem_reserved_gib"] for s in done)
        err = pred["step_time_s"] / step - 1
        print(f"{tag:<24}{len(done):>2}{pred['step_time_s']:>9.3f}{step:>9.3f}{err:>+7.1%}"
              f"{rate:>11,.0f}{mfu:>7.1%}{pred['memory_gib']['total']:>9.1f}{rsv:>9.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.suite")
    p.add_argument("suite")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--budget-s", type=float, default=540.0)
    args = p.parse_args(argv)
    try:
        rows = run_suite(args.suite, args.out, args.launches, args.only, args.budget_s)
    except TrainplanError as err:
        print(f"suite: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
