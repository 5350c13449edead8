"""A measurement series: predict every config first, then measure each in separate launches
(`python -m trainplan.bench.series.run` runs one).

1. Predictions: for every config of the suite, the planner prices exactly that
   layout (`trainplan.plan.planner.plan`, every dimension pinned: the `trainplan plan`
   code path) and a prediction record is appended to DIR/predictions.jsonl,
   stamped before any measurement of the series starts (docs/measurement.md,
   "Predictions first").
2. Measurements: each config is launched `--launches` times, each a fresh
   `torchrun` of `trainplan.bench.harness.train` appending a measurement record to
   DIR/measurements.jsonl; configs run in the suite's order, all launches of
   one before the next, so that a budget cut leaves whole configs. A launch
   that fails (out of memory, say) is written to DIR/failed.jsonl with its
   reason (the end of its output in DIR/logs/TAG-launchN.log), and the series
   goes on with the next config.
3. A short table (predicted vs measured step time, tokens/s/GPU, MFU, memory).

`--sweep` (off by default) measures differently in step 2: each of the
`--launches` repetitions is one torchrun launch per GPU count that runs all
of that count's configs in turn (`trainplan.bench.series.sweep`, order rotated by
one per repetition), each config still its own measurement record, marked in
its `notes` (suite_sweep.py). It saves the ~20 s start of every launch; that
its GPU timings equal separate launches' is still to be shown.

NVLink multicast stays off in every launch (NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainplan.bench.flags import LOSSES, harness_entry  # a config's `loss:`; its module
from trainplan.calibrate.store import card_preset, load_gpu
from trainplan.cost import memory_runtime as rt
from trainplan.errors import SpecError, TrainplanError
from trainplan.loader import load_yaml, quote, shown
from trainplan.plan.planner import plan
from trainplan.proctree import failure_reason, stop_tree
from trainplan.records import schema as records
from trainplan.specs import LAYOUT_FIELDS, from_mapping, load_cluster, load_model, slice_name
from trainplan.specs import ParallelConfig as Layout
from trainplan.specs.bounds import MAX_GPUS, MAX_SEQ_LEN

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "zero", "dp_shard", "micro_batch", "grad_accum",
                "recompute", "pp_schedule", "pp_virtual")
PRECISIONS, RECIPES = ("bf16", "fp8"), ("tensorwise", "rowwise")  # `precision:`, `fp8_recipe:`
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")  # names DIR/logs/TAG-launchN.log
MAX_STEPS = 10**6  # steps (or warm-up steps) of one launch


def load_suite(path: str) -> dict:
    suite = load_yaml(path, what="suite (YAML)")
    path = shown(path)
    if not isinstance(suite, dict) or not isinstance(suite.get("configs"), list):
        raise SpecError(f"suite {path}: expected a mapping with a 'configs' list")
    tags = set()
    for c in suite["configs"]:
        if not isinstance(c, dict) or not isinstance(c.get("layout", {}), dict):
            raise SpecError(f"suite {path}: config {quote(c)} is not a mapping with a "
                            "'layout' mapping")
        unknown = set(c.get("layout", {})) - set(LAYOUT_FLAGS) - {"ep"}
        gpus = c.get("gpus")
        if not isinstance(c.get("tag"), str) or isinstance(gpus, bool) or not isinstance(
                gpus, int) or not 1 <= gpus <= MAX_GPUS or unknown:
            raise SpecError(f"suite {path}: config {quote(c)} needs 'tag' (a string) and "
                            f"'gpus' (1 to {MAX_GPUS:,}); layout keys are {list(LAYOUT_FLAGS)}")
        tag = quote(c["tag"])
        if not TAG.fullmatch(c["tag"]) or c["tag"] in tags:
            raise SpecError(f"suite {path}: config tag {tag} is " + ("given twice" if c["tag"] in
                            tags else "not valid") + "; use a unique tag of letters, digits and "
                            ". _ + - (it names the config's log files)")
        tags.add(c["tag"])
        from_mapping(Layout, full_layout(c), f"suite {path}: config {tag} layout")
        for key, low in (("steps", 0), ("warmup", 0), ("layers", 1)):  # layers: a slice
            n = c.get(key, suite.get(key, low))  # 0 steps: the harness's to refuse, in a launch
            if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= MAX_STEPS:
                raise SpecError(f"suite {path}: config {tag} {key} = {quote(n)}; use a whole "
                                f"number {low} to {MAX_STEPS:,}")
        extra = c.get("extra_args", suite.get("extra_args", []))
        if not isinstance(extra, list) or not all(type(a) in (str, int, float) for a in extra):
            raise SpecError(f"suite {path}: config {tag} extra_args = {quote(extra)}; use a list "
                            "of the harness's arguments (strings and numbers)")
        if not all(isinstance(c.get(k, False), bool) for k in ("compile", "naive")):
            raise SpecError(f"suite {path}: config {tag} compile, naive = {quote(c.get('compile'))}"
                            f", {quote(c.get('naive'))}; use true or false")
        prec = precision(suite, c)
        if prec["precision"] not in PRECISIONS or prec.get("fp8_recipe", RECIPES[0]) \
                not in RECIPES:
            raise SpecError(f"suite {path}: config {tag} precision = {quote(prec)}; use "
                            f"precision {list(PRECISIONS)} and fp8_recipe {list(RECIPES)}")
        if loss_of(suite, c)["loss"] not in LOSSES:
            raise SpecError(f"suite {path}: config {tag} loss = {quote(loss_of(suite, c)['loss'])}"
                            f"; use one of {list(LOSSES)}")
        if c.get("impl", "trainplan") not in records.IMPLS:
            raise SpecError(f"suite {path}: config {tag} has impl = {quote(c['impl'])}; "
                            f"use one of {list(records.IMPLS)}")
        if not isinstance(c.get("model", suite.get("model")), str):
            raise SpecError(f"suite {path}: config {tag} names no model; give the suite or "
                            "the config a 'model' (a preset or a YAML file)")
        seq = seq_len(suite, c)
        if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= MAX_SEQ_LEN:
            raise SpecError(f"suite {path}: config {tag} seq_len = {quote(seq)}; "
                            f"use a whole number 1 to {MAX_SEQ_LEN:,} (tokens a sequence)")
        try:  # an unknown model or too many layers: before any run
            load_model(model_name(suite, c))
        except SpecError as err:
            raise SpecError(f"suite {path}: config {tag}: {err}") from None
    return suite


def base_model(suite: dict, cfg: dict) -> str:
    """The model a config runs: its own `model`, else the suite's (a preset or YAML file)."""
    return cfg.get("model", suite.get("model"))


def precision(suite: dict, cfg: dict) -> dict:
    """A config's {"precision"} (its own, else the suite's, else bf16), with `fp8_recipe`
    (its own, else the suite's, else tensorwise) for fp8: the records' layout fields."""
    value = cfg.get("precision", suite.get("precision", "bf16"))
    recipe = cfg.get("fp8_recipe", suite.get("fp8_recipe", RECIPES[0]))
    return {"precision": value, **({"fp8_recipe": recipe} if value == "fp8" else {})}


def loss_of(suite: dict, cfg: dict) -> dict:
    """A config's {"loss"} (its own, else the suite's, else standard): the records' layout
    field; fused is the chunked output layer + cross-entropy (`bench.harness.loss`)."""
    return {"loss": cfg.get("loss", suite.get("loss", "standard"))}


def seq_len(suite: dict, cfg: dict) -> int:
    """Tokens a sequence for a config: its own `seq_len`, else the suite's, else 2048."""
    return cfg.get("seq_len", suite.get("seq_len", 2048))


def card_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_preset(card: str, suite: dict) -> str:
    """The GPU preset of a card's name (nvidia-smi's), else the suite's `gpu` (h100-sxm)."""
    return card_preset(card) or suite.get("gpu", "h100-sxm")


def full_layout(cfg: dict) -> dict:
    """The config's layout with every field the planner pins (ParallelConfig's defaults)."""
    lay = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "micro_batch": 1,
           "grad_accum": 1, "recompute": "none", "pp_schedule": "1f1b", "pp_virtual": 1}
    lay.update(cfg.get("layout", {}))
    lay.setdefault("dp_shard", lay["dp"] if lay["zero"] else 1)
    return lay


def predict(suite: dict, cfg: dict, card: str, run_id: str) -> dict:
    """The planner's figures for exactly this layout, as a prediction record: priced with
    the config's precision and loss (`precision`, `loss_of`), which its layout names."""
    lay = full_layout(cfg)
    seq = seq_len(suite, cfg)
    gpu = load_gpu(gpu_preset(card, suite))
    tokens = lay["dp"] * lay["micro_batch"] * lay["grad_accum"] * seq
    cluster = load_cluster(suite.get("cluster", "dgx-h100"))
    prec = precision(suite, cfg)
    allocator = rt.allocator_of(os.environ, unset=rt.EXPANDABLE)  # the harness's, unless set
    out = plan(load_model(model_name(suite, cfg)), gpu, cluster,
               gpus=cfg["gpus"], seq_len=seq, global_batch_tokens=tokens, pins=lay,
               compiled=bool(cfg.get("compile", False)), precision=prec["precision"],
               fp8_recipe=prec.get("fp8_recipe", RECIPES[0]), loss=loss_of(suite, cfg)["loss"],
               allocator=allocator)
    p = out["plans"][0]
    predicted = {k: p[k] for k in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "fits")}
    predicted["memory_gib"] = p["memory_gib"]
    predicted["time_breakdown_s"] = p["time_breakdown_s"]
    layout = {**{k: lay[k] for k in LAYOUT_FIELDS},
              "compile": bool(cfg.get("compile", False)), **prec, **loss_of(suite, cfg)}
    return records.prediction_record(
        model=model_name(suite, cfg), layout=layout, gpus=cfg["gpus"], card=card,
        predicted=predicted,
        config={"tag": cfg["tag"], "gpu_preset": gpu.name, "seq_len": seq, "full_layout": lay,
                "impl": cfg.get("impl", "trainplan"), "allocator": allocator},
        run_id=run_id)


def train_command(suite: dict, cfg: dict, out: Path, run_id: str) -> list[str]:
    module, impl = harness_entry(cfg.get("impl", "trainplan"))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={cfg['gpus']}", "-m", module,
            *train_args(suite, cfg, out, run_id), *impl]


def train_args(suite: dict, cfg: dict, out: Path, run_id: str) -> list[str]:
    """The config's arguments to train.py, but for `--impl`."""
    lay = full_layout(cfg)
    cmd = ["--model", base_model(suite, cfg), "--seq-len", str(seq_len(suite, cfg)),
           "--steps", str(cfg.get("steps", suite.get("steps", 12))),
           "--warmup", str(cfg.get("warmup", suite.get("warmup", 4))),
           "--records", str(out / "measurements.jsonl"), "--run-id", run_id, "--json",
           "--tag", cfg["tag"]]
    for k in LAYOUT_FLAGS:
        cmd += [f"--{k.replace('_', '-')}", str(lay[k])]
    if cfg.get("compile"):
        cmd.append("--compile")
    for key, value in precision(suite, cfg).items():  # bf16 is train.py's default too
        cmd += [f"--{key.replace('_', '-')}", value] if value != "bf16" else []
    if loss_of(suite, cfg)["loss"] != "standard":  # train.py's default
        cmd += ["--loss", loss_of(suite, cfg)["loss"]]
    if cfg.get("layers"):
        cmd += ["--layers", str(cfg["layers"])]
    cmd += [str(a) for a in cfg.get("extra_args", suite.get("extra_args", []))]
    return cmd


def model_name(suite: dict, cfg: dict) -> str:
    """The model a config trains (its own or the suite's), or its first `layers` blocks
    (`NAME:N-layers`, the name train.py records and `specs.load_model` reads)."""
    name = base_model(suite, cfg)
    return slice_name(name, cfg["layers"]) if cfg.get("layers") else name


def predict_all(jobs: list[tuple[dict, dict]], out: Path, card: str, run_id: str) -> dict:
    """A prediction record per (suite, config), all appended before any launch; tag -> record."""
    preds = {cfg["tag"]: predict(suite, cfg, card, run_id) for suite, cfg in jobs}
    for record in preds.values():  # all priced first: a config that fails leaves no file
        records.append(out / "predictions.jsonl", record)
    return preds


FIRST_LAUNCH_GUESS_S = 40.0  # before any launch has been timed (H200 x 2: 23-42 s a launch)


def time_needed(took: list[float], launches_left: int) -> float:
    """Seconds `launches_left` more launches of a config should take, from the launches timed
    so far: the slowest once and the median for the rest (FIRST_LAUNCH_GUESS_S each before
    any). A config's first launch compiles and warms its loader and can take about twice
    the median, so the slowest launch is counted once, not for every launch left."""
    if not took:
        return FIRST_LAUNCH_GUESS_S * launches_left
    return max(took) + statistics.median(took) * (launches_left - 1)


def measure(jobs, preds: dict, out: Path, run_id: str, launches: int, deadline: float):
    """Launch each config `launches` times, in order, until `deadline` (time.monotonic()).

    A config starts only if all its launches fit (`time_needed`: the longest launch
    seen so far once, the median for the others); a launch still running at
    the deadline is stopped. A failed launch (out of memory, layout error,
    timeout) ends its config: a line goes to DIR/failed.jsonl with the reason
    and the next config runs. Returns (rows of (tag, predicted, summaries),
    outcomes: one dict per config with its status, `measured`, `failed` or
    `not run`, and the reason).
    """
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    rows, outcomes, took_all = [], [], []
    for i, (suite, cfg) in enumerate(jobs, 1):
        done, status, reason = [], "not run", "time budget spent before it started"
        for launch in range(launches):
            left = deadline - time.monotonic()
            need = time_needed(took_all, (launches - launch) if not done else 1)
            if need > left:
                if done:
                    reason = f"time budget spent after {len(done)} launch(es)"
                break
            t0 = time.monotonic()
            log = failure_log(out, cfg["tag"], launch + 1)
            log.unlink(missing_ok=True)  # a log left by an earlier series in DIR is not this one's
            summary, failure = launch_once(train_command(suite, cfg, out, run_id), env, left,
                                           log=log)
            took = time.monotonic() - t0
            took_all.append(took)
            if failure:
                status, reason = ("measured" if done else "failed"), failure
                kept = f"; its output: {log}" if log.is_file() else ""
                print(f"[{i}/{len(jobs)}] {cfg['tag']} launch {launch + 1}: FAILED ({failure}"
                      f"{kept})", flush=True)
                record_failure(out, suite, cfg, launch + 1, failure, run_id, log=log)
                break
            done.append(summary)
            status, reason = "measured", None
            print(f"[{i}/{len(jobs)}] {cfg['tag']} launch {launch + 1}/{launches}: "
                  f"{summary.get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU ({took:.0f} s)",
                  flush=True)
        rows.append((cfg["tag"], preds[cfg["tag"]]["predicted"], done))
        outcomes.append({"tag": cfg["tag"], "gpus": cfg["gpus"], "layout": full_layout(cfg),
                         "compile": bool(cfg.get("compile", False)), "status": status,
                         "launches": len(done), "reason": reason})
    return rows, outcomes


def launch_once(cmd: list[str], env: dict, timeout_s: float,
                log: Path | None = None) -> tuple[dict | None, str | None]:
    """One torchrun launch: (rank 0's summary, None), or (None, why it failed), the end of
    its output then kept in `log` (`write_log`)."""
    rc, stdout, stderr = run_group(cmd, env, timeout_s)
    if rc is None:
        return None, f"stopped at the time budget after {timeout_s:.0f} s"
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        return json.loads(lines[-1]), None
    if log is not None:
        write_log(log, stderr or stdout)
    return None, failure_reason(rc, stderr or stdout)


LOG_LINES = 400  # the end of a failed launch's output kept beside its record


def write_log(path: Path, text: str) -> None:
    """The last LOG_LINES lines of a failed launch's output in `path` (whole, or not at all):
    the record keeps one line of why, this keeps the traceback behind it. The host's name
    (torchrun prints it) reads `<host>`: records name hosts by hash only."""
    host = socket.gethostname()
    tail = "\n".join(text.splitlines()[-LOG_LINES:]) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if host:  # as a whole word only: a short name could be part of other words
        tail = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "<host>", tail)
    tmp.write_text(tail, encoding="utf-8")
    os.replace(tmp, path)


def failure_log(out: Path, tag: str, launch: int) -> Path:
    """Where a config's failed launch keeps its output: DIR/logs/TAG-launchN.log."""
    return out / "logs" / f"{tag}-launch{launch}.log"


def run_group(cmd: list[str], env: dict, timeout_s: float, capture: bool = True):
    """Run `cmd` in its own process group: (exit code, stdout, stderr), or (None, ...) when it
    ran past `timeout_s` and was killed, workers and all. Without `capture`, its stdout goes
    to this process's stderr and its stderr passes through (progress bars stay visible)."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, stdout=pipe if capture else _stderr_fd(), stderr=pipe,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        stop_tree(proc)
        stdout, stderr = proc.communicate()
        return None, stdout or "", stderr or ""
    return proc.returncode, stdout or "", stderr or ""


def gpu_processes(csv_text: str) -> list[tuple[int, int]]:
    """(pid, MiB) of each line of `nvidia-smi --query-compute-apps=pid,used_memory
    --format=csv,noheader,nounits`; lines that are not two numbers are skipped."""
    out = []
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            out.append((int(parts[0]), int(parts[1])))
    return out


def check_gpus_idle() -> None:
    """Refuse to measure on GPUs that other processes are using: their kernels would be timed
    with ours (a launch left running by a killed one, for instance). No nvidia-smi, no
    check."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return
    busy = gpu_processes(text)
    if busy:
        listed = ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in busy[:4])
        raise TrainplanError(f"GPUs busy: {len(busy)} other process(es) hold GPU memory "
                             f"({listed}); their kernels would be timed with ours. Stop them "
                             "or pass --allow-busy")


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test's capture: inherit
        return None


def record_failure(out: Path, suite: dict, cfg: dict, launch: int, reason: str,
                   run_id: str, log: Path | None = None) -> None:
    """A failed launch, as a `failed_launch` record in DIR/failed.jsonl (no measurement):
    `trainplan compare` lists it beside the configs it compares, with its prediction. `log`:
    the end of its output, just written (`write_log`), named relative to DIR."""
    records.append(out / "failed.jsonl", {
        **({"log": str(log.relative_to(out))} if log is not None and log.is_file() else {}),
        "kind": "failed_launch", "recorded_at": records.utc_now(),
        "provenance": records.provenance(), "run_id": run_id, "tag": cfg["tag"],
        "model": base_model(suite, cfg), "gpus": cfg["gpus"], "card": card_name(),
        "seq_len": seq_len(suite, cfg),
        "layout": {**full_layout(cfg), "compile": bool(cfg.get("compile", False)),
                   **precision(suite, cfg), **loss_of(suite, cfg)},
        "compile": bool(cfg.get("compile", False)), "launch": launch, "reason": reason})
