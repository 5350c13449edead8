"""Checkpoint benchmark: stall, persist throughput against the raw disk, restart to first step.

    torchrun --standalone --nproc-per-node 2 -m trainplan.bench.series.ckpt_bench --out DIR \\
        --ckpt-root /tmp/ck --model llama-1.3b --dp 2 --zero 2 --synthetic

One launch, one disk (`--ckpt-root`), the training run of `train.py` (its
flags pass through: model, layout, sequence, --synthetic, --cpu, ...) and its
`ckpt.Checkpointer` (the same save, commit and resume code as a real run):

1. raw write bandwidth: every rank writes `--raw-gib / ranks` GiB with fsync
   at once (`ckpt_disk`), bandwidth = bytes / slowest rank;
2. `--warmup` steps untimed, then `--steps-per-mode` steps with a synchronous
   DCP save every `--every` steps, then as many with `dcp.async_save`.
   Per save: `stall_s`, the loop blocked in the save call (slowest rank; for
   an asynchronous save the staging of the CPU copy, plus rank 0's commit
   when it lands between steps), `wait_prev_s` (an asynchronous save waiting
   for the previous one to finish writing: the interval was shorter than the
   persist time), `persist_s` (start until durable and committed: shards
   fsynced and hashed, manifest renamed) and the checkpoint's bytes;
3. restart to first step, in-process: the model, optimizer and checkpointer
   are torn down, rebuilt by the same code, the newest checkpoint is verified
   and loaded (`Checkpointer.resume`), and one step is run; a fingerprint of
   the state before teardown and after the load must match. Process start
   and process-group set-up, which a real restart adds, are timed from this
   launch (`cold_start_s`).

Rank 0 appends one `checkpoint` record (`trainplan.records.schema`) to
DIR/ckpt-records.jsonl and prints a short table last. The checkpoints live in
CKPT_ROOT/trainplan-ckpt-bench/ (emptied at the start; removed at the end
unless --keep-checkpoints).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainplan.bench.ckpt import disk as ckpt_disk
from trainplan.bench.ckpt import report as ckpt_report
from trainplan.bench.ckpt import store as ckpt
from trainplan.bench.ckpt.dcp_io import process_start
from trainplan.bench.harness import feed, train
from trainplan.bench.harness import parallelize as par_mod
from trainplan.bench.harness import step as step_mod
from trainplan.errors import TrainplanError
from trainplan.records import schema as records

SUBDIR = "trainplan-ckpt-bench"
RECORDS = "ckpt-records.jsonl"
_SET_HERE = ("--ckpt-dir", "--ckpt-every", "--ckpt-keep", "--ckpt-async", "--resume",
             "--records", "--steps")


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(benchmark flags, train.py flags); train.py's flags pass through unchanged."""
    p = argparse.ArgumentParser(prog="torchrun ... -m trainplan.bench.series.ckpt_bench",
                                description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog="Every other flag is train.py's (--model, --dp, --zero, "
                                       "--seq-len, --synthetic, --cpu, --warmup, ...).")
    a = p.add_argument
    a("--out", required=True, help="folder of ckpt-records.jsonl")
    a("--ckpt-root", required=True, help="checkpoint disk folder (raw write test and saves)")
    a("--raw-gib", type=float, default=8.0, help="GiB written by the raw write test, all ranks")
    a("--raw-block-mib", type=int, default=64, help="write size of the raw test (dd's bs)")
    a("--steps-per-mode", type=int, default=10, help="timed steps with sync saves, then async")
    a("--every", type=int, default=5, help="save every N steps in each mode")
    a("--keep", type=int, default=2, help="checkpoints kept (>= 2, as in a real run)")
    a("--run-id", default=None, help="shared by the launches of one series")
    a("--keep-checkpoints", action="store_true", help="leave CKPT_ROOT/" + SUBDIR + " behind")
    bench, rest = p.parse_known_args(argv)
    for flag in _SET_HERE:
        if any(x == flag or x.startswith(flag + "=") for x in rest):
            raise TrainplanError(f"{flag} is set by the benchmark; leave it out (use --every, "
                                 "--steps-per-mode, --keep, --ckpt-root)")
    steps = str(1 + 2 * bench.steps_per_mode + (_warmup(rest)))
    targs = train.parse_args([*rest, "--ckpt-dir", str(Path(bench.ckpt_root) / SUBDIR),
                              "--ckpt-async", "--ckpt-keep", str(bench.keep), "--steps", steps])
    return bench, targs


def _warmup(rest: list[str]) -> int:
    return train.parse_args(rest).warmup


def check_args(bench, targs) -> None:
    if not bench.raw_gib > 0:
        raise TrainplanError(f"--raw-gib = {bench.raw_gib} must be > 0 (e.g. 8)")
    if bench.raw_block_mib < 1:
        raise TrainplanError(f"--raw-block-mib = {bench.raw_block_mib} must be >= 1 (e.g. 64)")
    if bench.every < 1:
        raise TrainplanError(f"--every = {bench.every} must be >= 1")
    if bench.steps_per_mode < bench.every or bench.steps_per_mode % bench.every:
        raise TrainplanError(f"--steps-per-mode = {bench.steps_per_mode} must be a positive "
                             f"multiple of --every = {bench.every} (the last step is saved, "
                             "and resumed from)")
    if bench.keep < 2:
        raise TrainplanError(f"--keep = {bench.keep}: keep at least 2 (with 1 the only good "
                             "checkpoint is deleted before the next is known good)")
    for flag, folder in (("--out", bench.out), ("--ckpt-root", bench.ckpt_root)):
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TrainplanError(f"{flag} {folder}: cannot create it ({err.strerror})") from None
    if targs.pp > 1:
        raise TrainplanError(f"--pp = {targs.pp}: the checkpoint benchmark runs without "
                             "pipeline stages; use --pp 1")
    train.check_args(targs)


class Bench:
    """The run's model, optimizer, checkpointer and control group, and its timings."""

    def __init__(self, bench, targs):
        self.bench, self.args = bench, targs
        self.device = train.init_distributed(targs.cpu, ckpt.timeout(targs))
        self.cold_start_s = time.time() - process_start()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.ctl = dist.new_group(backend="gloo") if self.world > 1 else None
        self.root = Path(targs.ckpt_dir)
        self.spec, self.cfg = train.load_spec(targs), train.layout(targs)
        par_mod.check_layout(self.cfg, self.spec, self.world)
        self.mesh = par_mod.build_mesh(self.cfg, self.device.type)
        self.step = 0
        self.steps: list[dict] = []
        self.saves: list[dict] = []

    # ------------------------------------------------------------ small collectives

    def reduce(self, values: list[float], op=None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.ctl is not None:
            dist.all_reduce(t, op=op or dist.ReduceOp.MAX, group=self.ctl)
        return t.tolist()

    def barrier(self) -> None:
        if self.ctl is not None:
            dist.barrier(group=self.ctl)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ phases

    def raw_write(self) -> dict:
        total = int(self.bench.raw_gib * ckpt_disk.GiB)
        if self.rank == 0:  # ours: emptied at the start of every launch
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
        self.barrier()
        free = ckpt_disk.free_bytes(self.root)  # every rank, so every rank stops alike
        if free < total:
            raise TrainplanError(f"--raw-gib = {self.bench.raw_gib}: only "
                                 f"{free / ckpt_disk.GiB:.1f} GiB free under {self.root}")
        mine = ckpt_disk.measure(self.root / "raw", total_bytes=total, rank=self.rank,
                                 world=self.world, block=self.bench.raw_block_mib * ckpt_disk.MiB,
                                 barrier=self.barrier)
        slowest, = self.reduce([mine["seconds"]])
        written = mine["bytes"] * self.world
        if self.rank == 0:
            shutil.rmtree(self.root / "raw", ignore_errors=True)
        return {"bytes": written, "seconds": slowest, "gbps": written / slowest / 1e9,
                "writers": self.world, "block_mib": self.bench.raw_block_mib, "fsync": True,
                "data": "random"}

    def build(self, resume: bool) -> None:
        """Model, optimizer, batches and checkpointer, by train.py's own functions."""
        self.args.resume = resume
        self.par, self.loss_fn = train.build(self.spec, self.cfg, self.args, self.device,
                                             self.mesh)
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(list(self.par.parameters()), lr=self.args.lr,
                                           betas=(0.9, 0.95), weight_decay=0.1, **fused)
        self.saver = ckpt.Checkpointer(self.args, self.par, self.optimizer, rank=self.rank,
                                       world=self.world, device=self.device)
        self.step = self.saver.resume()
        dp_rank, dp = par_mod.dp_coordinates(self.cfg, self.mesh)
        self.batches = iter(feed.make_batches(self.args, self.cfg, self.spec, dp_rank, dp,
                                              self.step))

    def train_step(self, mode: str) -> float:
        writing = self.saver.pending is not None
        self.sync()
        start = time.perf_counter()
        micro = feed.to_device(next(self.batches), self.device,
                               non_blocking=self.args.pin_memory)
        step_mod.train_step(self.par, self.optimizer, micro,
                            autocast=self.device.type == "cuda" and not self.par.fsdp,
                            reshard=self.cfg.zero == 3, max_norm=self.args.max_norm,
                            loss_fn=self.loss_fn)
        self.sync()
        took = time.perf_counter() - start
        self.step += 1
        self.steps.append({"step": self.step, "mode": mode, "time_s": took, "writing": writing})
        return took

    def poll(self) -> None:
        """An asynchronous save that has finished is committed here, between steps (as
        `Checkpointer.after_step` does); the time is charged to that save's stall."""
        before = self.saver.last_committed
        start = time.perf_counter()
        self.saver._poll()
        took, = self.reduce([time.perf_counter() - start])
        for s in self.saves:
            if s["step"] == self.saver.last_committed != before:
                s["commit_in_loop_s"] = took

    def save(self, mode: str) -> None:
        self.saver.use_async = mode == "async"
        start = time.perf_counter()
        self.saver._wait()  # the previous asynchronous save, if it is still writing
        waited = time.perf_counter() - start
        start = time.perf_counter()
        self.saver.save(self.step)
        stall, waited = self.reduce([time.perf_counter() - start, waited])
        self.saves.append({"mode": mode, "step": self.step, "stall_s": stall,
                           "wait_prev_s": waited, "commit_in_loop_s": 0.0})

    def run_mode(self, mode: str) -> None:
        for _ in range(self.bench.steps_per_mode):
            self.train_step(mode)
            if mode == "async":
                self.poll()
            if (self.step - self.args.warmup) % self.bench.every == 0:
                self.save(mode)

    def restart(self) -> dict:
        """Tear down, rebuild, load the newest checkpoint, one step; timed on every rank."""
        self.saver._wait()
        self.saver.join_prune()
        last, final = self.saver.last_committed, self.step
        before = ckpt_report.fingerprint(self.par, self.optimizer)
        self.collect_write_timings()
        if self.saver._stager is not None:
            self.saver._stager.close()
        del self.par, self.optimizer, self.saver, self.batches
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.barrier()
        start = time.perf_counter()
        self.build(resume=True)
        self.sync()
        loaded = time.perf_counter()
        after = ckpt_report.fingerprint(self.par, self.optimizer)
        fp_s = time.perf_counter() - loaded
        first = self.train_step("restart")
        total, build_load, = self.reduce([time.perf_counter() - start - fp_s, loaded - start])
        same, = self.reduce([float(before == after)], dist.ReduceOp.MIN)
        resume = next((e for e in ckpt_report.events(self.root, "resume")), {})
        return {"how": "in-process: model, optimizer and checkpointer torn down and rebuilt",
                "resumed_step": self.step - 1, "last_committed": last,
                "load_s": resume.get("load_s"), "build_and_load_s": build_load,
                "first_step_s": first, "restart_to_first_step_s": total,
                "cold_start_s": self.reduce([self.cold_start_s])[0],
                # compared only where the state at teardown is the one saved last
                "state_matches": bool(same) if last == final else None}

    def collect_write_timings(self) -> None:
        """Each save's phases (slowest rank): preparing the folder, get_state_dict, the
        CPU copy (async), the async_save call in all, writing the shards (hashed as they
        are written, `dcp_io.shard_writer`), and the hashing left after writing (shards
        read back: none unless a stream was not written front to back)."""
        keys = ("prepare_s", "state_dict_s", "stage_s", "async_call_s", "write_s", "hash_s")
        mine = [self.saver.timings.get(s["step"], {}).get(k) for s in self.saves for k in keys]
        worst = self.reduce([-1.0 if v is None else v for v in mine]) if mine else []
        n = len(keys)
        for i, s in enumerate(self.saves):
            s["phases"] = {k: (v if v >= 0 else None)
                           for k, v in zip(keys, worst[n * i:n * i + n], strict=True)}


def run(bench, targs) -> dict | None:
    check_args(bench, targs)
    b = Bench(bench, targs)
    raw = b.raw_write()
    b.build(resume=False)
    need = ckpt_report.state_bytes(b.par, b.optimizer, b.reduce)
    if ckpt_disk.free_bytes(b.root) < need * (bench.keep + 1):
        raise TrainplanError(f"--ckpt-root {bench.ckpt_root}: {bench.keep} + 1 checkpoints of "
                             f"{need / 1e9:.1f} GB need more than the "
                             f"{ckpt_disk.free_bytes(b.root) / 1e9:.1f} GB free")
    for _ in range(targs.warmup):
        b.train_step("warmup")
    b.run_mode("sync")
    b.run_mode("async")
    options = b.saver.async_options
    restart = b.restart()
    b.saver._wait()
    b.saver.join_prune()
    if b.rank != 0:
        return None
    return ckpt_report.record(bench, targs, b, raw=raw, restart=restart,
                              async_options=options, state_bytes=need)


def main(argv=None) -> int:
    try:
        bench, targs = parse_args(argv)
        record = run(bench, targs)
        if record is not None:
            out = Path(bench.out) / RECORDS
            records.append(out, record)
            print(ckpt_report.table(record))
            print(f"record appended to {out}")
        if record is not None and not bench.keep_checkpoints:
            shutil.rmtree(Path(bench.ckpt_root) / SUBDIR, ignore_errors=True)
    except TrainplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
