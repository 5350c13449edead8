"""Distributed checkpoints of the proxy run: save, verify, keep the last k, resume.

One directory per step (DCP shards, per-rank RNG and data position, per-rank file hashes)
committed by `manifest.json`, written last: DCP has no content checksums (PyTorch DCP
documentation), so the manifest (every file's sha256 and size, renamed into place after
every rank's shards and DCP's .metadata are on disk) is the commit record, and a directory
without it is ignored. Resume takes the newest checkpoint that verifies, says in one line
which and why, and `dcp.load` reshards it to the current layout; only tensors are stored,
so nothing is unpickled beyond DCP's verified index. Where folders claim to be checkpoints
but none verifies, --resume refuses (exit 2) unless --fresh (`resume_choice`, which
`trainplan train` also asks before torchrun starts). Retention keeps the last k >= 2
verified checkpoints. A run whose final save failed ends in failure (`final_failure`).
The layout on disk is in bench/README.md, "Checkpoints on disk".
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt.dcp_io import (
    CheckpointError,
    PendingSave,
    dcp_errors,
    make_stager,
    one_line,
    one_process,
    process_start,
    tensors_only_planner,
)
from trainplan.bench.ckpt.faults import Faults, Signals, digest_steps
from trainplan.bench.ckpt.save import FORMAT, SaveMixin  # noqa: F401 (FORMAT: re-exported)
from trainplan.bench.flags import CKPT_DEFAULTS, MAX_COLLECTIVE_TIMEOUT_S
from trainplan.bench.flags import add_checkpoint_arguments as add_arguments  # noqa: F401
from trainplan.loader import nearest_existing, shown

EVENTS = "events.jsonl"
GRACE_S = 30.0  # torchrun's SIGTERM-to-SIGKILL wait (and Slurm's default KillWait)


# ---------------------------------------------------------------- flags


def check_args(args) -> None:
    if args.ckpt_keep < 2:
        raise CheckpointError(f"--ckpt-keep = {args.ckpt_keep}: keep at least 2 (with 1 the only "
                              "good checkpoint is deleted before the next is known good)")
    if args.ckpt_every < 0:
        raise CheckpointError(f"--ckpt-every = {args.ckpt_every} must be >= 0 (0 = at the end)")
    if not args.ckpt_dir:
        given = [f"--{k.replace('_', '-')}" for k in ("resume", "ckpt_async", "ckpt_every")
                 if getattr(args, k)]
        given += [f"--{k.replace('_', '-')} {getattr(args, k)}"
                  for k, default in CKPT_DEFAULTS.items() if getattr(args, k) != default]
        if given:
            raise CheckpointError(f"{given[0]} needs --ckpt-dir DIR (without it nothing is "
                                  "saved or resumed)")
    if args.fresh and not args.resume:
        raise CheckpointError("--fresh qualifies --resume (start at step 0 where no checkpoint "
                              "verifies); pass both, or neither")
    if args.ckpt_threads < 1:
        raise CheckpointError(f"--ckpt-threads = {args.ckpt_threads} must be >= 1")
    t = args.collective_timeout_s
    if t is not None and not (math.isfinite(t) and 0 < t <= MAX_COLLECTIVE_TIMEOUT_S):
        raise CheckpointError(f"--collective-timeout-s = {t} must be a number of seconds > 0, "
                              f"at most {MAX_COLLECTIVE_TIMEOUT_S} (7 days)")


def resume_choice(root: Path, resume: bool, fresh: bool, contents: bool = True) -> tuple:
    """Rank 0's answer for the checkpoint folder `root`: ("ok", path or None, manifest, line
    or None), or ("error", line) where folders claim to be checkpoints (hold a manifest) and
    not `resume`, or where none of them verifies and not `fresh`: starting again at step 0
    would lose the run, and its saves would not count. `contents=False` verifies without
    reading the checkpoints' files (`mf.verify`): its errors are this function's errors,
    its "ok" may not be (`trainplan train` asks so before torchrun starts)."""
    complete = mf.committed(root)
    if not resume:
        if complete:
            return "error", (f"--ckpt-dir {root} already holds checkpoints (newest "
                             f"{complete[0]}); pass --resume to continue, or use an empty folder")
        return "ok", None, None, None
    path, manifest, line = mf.choose(root, contents=contents)
    if path is not None or not complete:
        return "ok", str(path) if path else None, manifest, (
            line if path else f"{line}; starting at step 0")
    if not fresh:
        return "error", f"--resume: {line}; pass --fresh to start at step 0 anyway"
    return "ok", None, None, f"{line}; starting at step 0 (--fresh)"


def check_root(root: Path, make: bool = False, flag: str = "--ckpt-dir") -> None:
    """CheckpointError where `flag`'s folder `root` is not a folder and cannot be made one (it,
    or its nearest existing parent, is not a folder, or not writable here); `make`: make it."""
    found, why = nearest_existing(root)  # found None: `why` is the OS's reason
    if found is not None and why == "not a folder":
        where = "" if found == root.absolute() else f" is in {shown(found)}, which"
        raise CheckpointError(f"{flag} {shown(root)}{where} is not a folder; name a "
                              "folder for the run's files (new, or the run's own)")
    if found is not None and why:
        raise CheckpointError(f"{flag} {shown(root)}: cannot write in {shown(found)};"
                              " name a folder you can write to")
    if make and not why:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            why = err.strerror
    if why:
        raise CheckpointError(f"{flag} {shown(root)} cannot be used ({why}); name a "
                              "folder you can write to")


def check_steps(name: str, step: int, steps: int | None) -> None:
    """CheckpointError where the checkpoint to resume, `name` saved at step `step`, is past
    `steps`, the run's last step (--steps counts the resumed steps too; None: no limit)."""
    if steps is not None and step > steps:
        raise CheckpointError(f"--resume: {name} was saved at step {step}, past --steps "
                              f"{steps} (the run's last step, not the steps left to run); "
                              f"give --steps {step + 1} or more to train on from it, or "
                              "another --ckpt-dir to start again")


def timeout(args) -> timedelta | None:
    return timedelta(seconds=args.collective_timeout_s) if args.collective_timeout_s else None


def final_failure(summary: dict) -> str | None:
    """The one line for a run that ended (not preempted) without its final checkpoint, else
    None; the run must then exit with a failure (1), not success."""
    ck = summary.get("checkpoint") or {}
    if not ck.get("final_failed") or summary.get("preempted"):
        return None
    last = ck.get("last_committed")
    return (f"the run ended but its final checkpoint was not saved (the FAILED line above "
            f"says why); newest committed: {mf.step_name(last) if last is not None else 'none'}"
            "; rerun with --resume to redo the steps after it")


# ---------------------------------------------------------------- the run's checkpointer


class Checkpointer(SaveMixin):
    """Checkpoints of one run: `resume()` once, `before_step`/`after_step` around every
    step, `finish()` at the end. Without --ckpt-dir only faults and digests act."""

    def __init__(self, args, par, optimizer, *, rank: int, world: int, device,
                 stateful: dict | None = None, total_steps: int | None = None):
        # stateful: name -> object with state_dict() / load_state_dict(), JSON-able state
        # (a data position, a learning-rate schedule), saved in each rank's own file;
        # total_steps: the run's last step, which a checkpoint to resume must not be past
        self.stateful = dict(stateful or {})
        self.total_steps = total_steps
        self.root = Path(args.ckpt_dir) if args.ckpt_dir else None
        self.every, self.keep, self.use_async = args.ckpt_every, args.ckpt_keep, args.ckpt_async
        self.want_resume, self.fresh = args.resume, args.fresh
        self.threads = args.ckpt_threads
        self.hash_while_writing = args.ckpt_hash == "while-writing"
        self.timings: dict[int, dict] = {}  # step -> this rank's phases of its save (seconds)
        self.model, self.optimizer = par.parts[0], optimizer
        self.rank, self.world, self.device = rank, world, device
        self.faults = Faults(rank, world,
                             log=lambda event, **fields: self.event(event, True, **fields))
        self.digest_on, self.digest_at = digest_steps()
        self.pending: PendingSave | None = None
        self._stepped = False
        self._stager = make_stager(device) if self.use_async else None
        self.last_committed: int | None = None
        self._checked: dict[tuple, bool] = {}  # manifest file -> verifies (`_remember`)
        self.stats = {"resumed_from": None, "saves": [], "failed": [], "emergency": []}
        if self.root is not None and len(par.parts) > 1:
            raise CheckpointError(f"--ckpt-dir with {len(par.parts)} pipeline stages on one rank "
                                  "(--pp-virtual > 1) is not implemented; use --pp-virtual 1")
        self.save_pg = self.ctl_pg = None
        if world > 1 and (self.root is not None or self.digest_on):
            # DCP's collectives (a background thread when async) and this class's small
            # control collectives each get their own gloo group: never interleaved with
            # each other or with training's collectives, and CPU tensors on any backend
            self.save_pg = dist.new_group(backend="gloo", timeout=timeout(args))
            self.ctl_pg = dist.new_group(backend="gloo", timeout=timeout(args))
        if self.root is not None:
            check_root(self.root, make=True)
            Signals.install()
            self._log_crashes()

    # ------------------------------------------------------------ logging

    def event(self, event: str, any_rank: bool = False, **fields) -> None:
        """One JSON line in DIR/events.jsonl (rank 0's, or any rank's; one write each, so
        lines of several processes do not mix)."""
        if self.root is None or (self.rank and not any_rank):
            return
        line = json.dumps({"t": time.time(), "event": event, "rank": self.rank,
                           "attempt": self.faults.attempt if hasattr(self, "faults") else 0,
                           **fields}) + "\n"
        try:
            fd = os.open(self.root / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # the log must never be what breaks a run (e.g. under a `full` fault)

    def _log_crashes(self) -> None:
        """Record an exception that ends this process (a collective timeout, a lost peer)
        with its time and step, so the restart path can be timed from the log."""
        previous = sys.excepthook

        def hook(kind, value, tb):
            self.event("crash", True, step=self.faults.step, error=one_line(value))
            previous(kind, value, tb)

        sys.excepthook = hook

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(f"trainplan ckpt: {line}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ collectives

    def _all(self, ok: bool) -> bool:
        """True when every rank is ok (a barrier as well)."""
        if self.ctl_pg is None:
            return ok
        t = torch.tensor([int(ok)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctl_pg)
        return bool(t.item())

    def _max(self, code: int) -> int:
        if self.ctl_pg is None:
            return code
        t = torch.tensor([code])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl_pg)
        return int(t.item())

    def _from_rank0(self, obj):
        if self.ctl_pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctl_pg)
        return box[0]

    # ------------------------------------------------------------ resume

    def resume(self) -> int:
        """Load the newest verified checkpoint if --resume; return the step to start from."""
        if self.root is None:
            return 0
        choice = None
        if self.rank == 0:
            choice = resume_choice(self.root, self.want_resume, self.fresh)
        choice = self._from_rank0(choice)
        if choice[0] == "error":
            raise CheckpointError(choice[1])
        _, path, manifest, line = choice
        if path is not None:
            check_steps(Path(path).name, manifest["step"], self.total_steps)
        if line:
            self.say(line)
        if path is None:
            if self.want_resume:
                self.event("resume", step=0, line=line)
            return 0
        start = time.perf_counter()
        self._remember(Path(path), True)  # verified by `mf.choose` just now
        self._load(Path(path), manifest)
        step = manifest["step"]
        self.last_committed = step
        self.stats["resumed_from"] = step
        self.event("resume", step=step, line=line, load_s=time.perf_counter() - start,
                   saved_world=manifest["world_size"])
        if manifest["world_size"] != self.world:
            self.say(f"{Path(path).name} was saved by {manifest['world_size']} ranks, loaded by "
                     f"{self.world} (resharded by DCP)")
        if self.digest_on:
            self.log_digest(step, "load")
        return step

    def _load(self, path: Path, manifest: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # inits Adam's state
        state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
        try:
            with one_process():
                dcp.load(state, checkpoint_id=str(path), planner=tensors_only_planner(),
                         process_group=self.save_pg, no_dist=not dist.is_initialized())
        except dcp_errors() as err:
            raise CheckpointError(f"loading {path} failed: {one_line(err)}") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"]["state"],
                                         "param_groups": optim_sd["param_groups"]})
        own = path / f"rank-{self.rank:05d}.json"
        if own.is_file():  # a rank the saving run did not have keeps its fresh RNG
            saved = mf.read_json(own)  # its sha256 was verified with the manifest
            mf.restore_rank_state(saved, self.device)
            for name, obj in self.stateful.items():
                if name not in saved.get("extra", {}):
                    raise CheckpointError(f"{own} has no {name!r} state to continue from; "
                                          "it was not saved by this kind of run")
                obj.load_state_dict(saved["extra"][name])
        elif self.stateful:
            raise CheckpointError(f"{path.name} was saved by {manifest['world_size']} ranks; "
                                  f"its {sorted(self.stateful)} state cannot continue on "
                                  f"{self.world} ranks (rank {self.rank} has no file)")

    # ------------------------------------------------------------ the loop

    def before_step(self, step: int) -> None:
        """Called as step `step` (1-based) begins: the `step` fault point."""
        self.faults.at("step", step)

    def after_step(self, step: int) -> bool:
        """After step `step`: digest, async bookkeeping, signals, the periodic save.
        Returns True when the run must stop (SIGTERM, after its emergency checkpoint)."""
        if self.digest_on and step in self.digest_at:
            self.log_digest(step, "step")
        if self.root is None:
            return False
        if not self._stepped:  # restart cost, for the GPU figures: process start to here
            self._stepped = True
            self.event("first_step", step=step, since_start_s=time.time() - process_start())
        self._poll()
        code = self._max(Signals.pending())
        if code:
            self._emergency(step, code)
            return code == 2
        if self.every and step % self.every == 0:
            self.save(step)
        return False

    def finish(self, step: int) -> dict:
        """Wait for a save in flight, save the final step; return the checkpoint summary, with
        `final_failed` True on every rank where the last step is not committed."""
        if self.root is not None:
            self._wait()
            if step > 0 and self.last_committed != step:
                self.save(step, reason="final")
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self.join_prune()
            self.stats["final_failed"] = not self._all(step == 0 or self.last_committed == step)
        if self.digest_on:
            self.stats["digest"] = self.log_digest(step, "end")
        return dict(self.stats, last_committed=self.last_committed)

    def _emergency(self, step: int, code: int) -> None:
        name = "SIGTERM" if code == 2 else "SIGUSR1"
        start = time.time()
        self._wait()
        if self.last_committed != step:
            self.save(step, reason=name)
        took = time.time() - start
        ok = self.last_committed == step
        self.stats["emergency"].append({"signal": name, "step": step, "ok": ok, "took_s": took})
        self.event("emergency", signal=name, step=step, ok=ok, took_s=took, grace_s=GRACE_S)
        self.say(f"{name}: emergency checkpoint {mf.step_name(step)} "
                 f"{'committed' if ok else 'FAILED'} in {took:.2f} s (grace {GRACE_S:.0f} s)"
                 + ("; stopping" if code == 2 else "; training goes on"))

    # ------------------------------------------------------------ digest

    def log_digest(self, step: int, when: str) -> str:
        """sha256 over every model and optimizer tensor, gathered whole (a test aid)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True))
        flat = {f"model.{k}": v for k, v in model_sd.items()}
        flat.update({f"optim.{fqn}.{name}": v for fqn, st in optim_sd["state"].items()
                     for name, v in st.items()})
        mine = {k: _tensor_sha(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        merged = dict(mine)
        if self.ctl_pg is not None:  # pipeline stages hold different keys
            every = [None] * self.world
            dist.all_gather_object(every, mine, group=self.ctl_pg)
            for part in every:
                merged.update(part)
        digest = hashlib.sha256("\n".join(f"{k}={v}" for k, v in sorted(merged.items()))
                                .encode()).hexdigest()
        self.event("digest", step=step, when=when, digest=digest, tensors=len(merged))
        return digest


def _tensor_sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
