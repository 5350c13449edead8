"""Saving a checkpoint: synchronous or asynchronous DCP save, commit, failure.

The half of `ckpt.Checkpointer` that writes (`SaveMixin`); the class in
`ckpt.py` holds the state it uses (root, model, optimizer, rank, world,
faults, process groups, the stager, `pending`, `last_committed`, `stats`) and
the small helpers (`event`, `say`, `_all`).

A save, every rank: rank 0 makes the step folder, every rank writes its RNG
and data position, then DCP writes the shards (each rank hashing its own as
it writes them, `dcp_io.shard_writer`; `--ckpt-hash after-writing` reads them
back instead, to compare). Synchronous saves block until DCP is
done and then commit; asynchronous ones return once DCP has staged a CPU copy
and are committed when the background write ends (`_poll` between steps,
`_wait` before the next save or at the end). The commit is rank 0 writing
the manifest (temporary name, fsync, rename), then pruning to the last k
verified checkpoints on a background thread (`_prune`).

Times recorded per save: `stall_s` (the training loop blocked in `save`),
`persist_s` (from the save's start until the manifest is renamed: durable
and committed; for an asynchronous save the end of the background write plus
the commit, not the time of the next poll).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch.distributed as dist

from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt.dcp_io import (
    CheckpointError,
    PendingSave,
    async_save,
    dcp_errors,
    one_line,
    one_process,
    shard_writer,
)

FORMAT = mf.FORMAT  # of the manifest


class SaveMixin:
    """save / _poll / _wait / _done / _commit / _committed / _failed of `ckpt.Checkpointer`."""

    async_options: dict | None = None  # what dcp.async_save was given (dcp_io.async_save)
    _checked: dict[tuple, bool]  # manifest file -> verifies (`_remember`); set by the class

    def save(self, step: int, reason: str = "interval") -> None:
        """Save `step` (every rank calls it); async for periodic saves with --ckpt-async."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._wait()
        path = self.root / mf.step_name(step)
        started = time.perf_counter()
        error = None
        if self.rank == 0:
            try:  # a folder of this step left by a crashed attempt, or a corrupt one
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True)
            except OSError as err:
                error = err
        if self._all(error is None):
            try:
                state = mf.rank_state(step, self.rank, self.world, self.device)
                if self.stateful:
                    state["extra"] = {k: v.state_dict() for k, v in self.stateful.items()}
                mf.write_json(path / f"rank-{self.rank:05d}.json", state)
                self.faults.at("save:staging", step)
            except OSError as err:
                error = err
        if not self._all(error is None):
            self.faults.restore()
            return self._failed(step, path, error or RuntimeError("another rank failed"),
                                reason)
        timings = self.timings.setdefault(step, {})
        timings["prepare_s"] = time.perf_counter() - started  # folder, RNG file, agreement
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
        timings["state_dict_s"] = time.perf_counter() - started - timings["prepare_s"]
        writer = shard_writer(path, rank=self.rank, step=step, faults=self.faults,
                              threads=self.threads, timings=timings,
                              hash_while_writing=self.hash_while_writing)
        solo = not dist.is_initialized()
        try:
            with one_process():
                if self.use_async and reason == "interval":
                    future, self.async_options = async_save(
                        state, writer=writer, process_group=self.save_pg, no_dist=solo,
                        stager=self._stager)
                    pending = PendingSave(step, path, future, started,
                                          time.perf_counter() - started, reason)
                    timings["stage_s"] = getattr(self._stager, "last_stage_s", None)
                    timings["async_call_s"] = pending.stall_s - timings["prepare_s"] \
                        - timings["state_dict_s"]
                    future.add_done_callback(  # timed where it ends, not at the next poll
                        lambda _: setattr(pending, "written", time.perf_counter()))
                    self.pending = pending
                    return None
                dcp.save(state, storage_writer=writer, process_group=self.save_pg,
                         no_dist=solo)
        except dcp_errors() as err:
            self.faults.restore()
            return self._failed(step, path, err, reason)
        self.faults.restore()
        self._done(step, path, started, time.perf_counter() - started, reason)
        return None

    def _poll(self) -> None:
        if self.pending is not None and self.pending.future.done():
            self._wait()

    def _wait(self) -> None:
        """Finish the save in flight, if any: commit it, or report its failure."""
        p, self.pending = self.pending, None
        if p is None:
            return
        try:
            p.future.result()
        except dcp_errors() as err:
            self.faults.restore()
            return self._failed(p.step, p.path, err, p.reason)
        self.faults.restore()
        self._done(p.step, p.path, p.started, p.stall_s, p.reason, p.written)
        return None

    def _done(self, step: int, path: Path, started: float, stall_s: float, reason: str,
              written: float | None = None) -> None:
        """DCP finished on every rank: rank 0 writes the manifest, the commit point.
        persist_s: from the save's start to durable and committed (for an async save,
        the background write's end plus the commit, not the time of the next poll)."""
        commit_start, size = time.perf_counter(), None
        if self.rank == 0:
            try:
                manifest = self._commit(step, path, reason)
            except (OSError, CheckpointError) as err:  # not committed: its folder goes
                return self._failed(step, path, err, reason)
            size = self._committed(step, path, reason, manifest)  # nothing here deletes it
        now = time.perf_counter()
        persist_s = (written or commit_start) - started + (now - commit_start)
        self.last_committed = step
        self.stats["saves"].append({"step": step, "reason": reason, "stall_s": stall_s,
                                    "persist_s": persist_s})
        self.event("saved", step=step, reason=reason, stall_s=stall_s, persist_s=persist_s,
                   bytes=size)
        return None

    def _commit(self, step: int, path: Path, reason: str) -> dict:
        """Write the manifest (the commit point); return it. An error here leaves the
        checkpoint uncommitted, for `_failed` to remove."""
        self.faults.at("save:metadata", step)
        try:
            manifest = mf.build(path, step=step, world=self.world, **{
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "reason": reason, "async": self.use_async and reason == "interval",
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups]})
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        mf.write_json(path / mf.MANIFEST, manifest,
                      before_rename=lambda: self.faults.at("save:manifest", step))
        return manifest

    def _committed(self, step: int, path: Path, reason: str, manifest: dict) -> int:
        """After the commit of `path`: remember it, prune, say so; return its bytes. Called
        outside the handler that removes a failed save's folder, so that nothing from here on
        (a log line whose reader is gone) can remove a committed checkpoint."""
        self._remember(path, True)  # its hashes were taken from the bytes as written
        self.faults.at("save:committed", step)
        self._prune()
        files = manifest["files"]
        size = sum(e["bytes"] for e in files.values())
        self.say(f"saved {path.name} ({len(files)} files, {size / 1e6:.2f} MB, {reason})")
        return size

    def _remember(self, path: Path, ok: bool | None = None) -> bool:
        """Whether checkpoint `path` verifies, remembered per manifest file (name, inode, size,
        time): `ok` records it (a folder this run committed, or the one it resumed from);
        without `ok` an unknown folder is verified once (`mf.verify`), a corrupt one too."""
        checked = self._checked
        try:
            st = (path / mf.MANIFEST).stat()
        except OSError:
            return False
        key = (path.name, st.st_ino, st.st_size, st.st_mtime_ns)
        if ok is not None:
            checked[key] = ok
        elif key not in checked:
            checked[key] = mf.verify(path)[0] is not None
        return checked[key]

    def _prune(self) -> None:
        """Delete checkpoints beyond the last k verified ones (`mf.prunable`) on a background
        thread, which says which. On 2 H200s (torch 2.11) a second asynchronous save
        stalled 4.8 s waiting for rank 0 to commit the first, most of it (by elimination:
        the rest of the commit reads a few small files) removing a 16 GB checkpoint while
        the other ranks waited; choosing may verify a folder this run has not seen (after a
        resume), which reads it whole. Only folders older than the newest verified one are
        chosen, so nothing a later save writes; `join_prune` waits (`finish` calls it)."""
        self.join_prune()

        def prune() -> None:
            try:
                doomed = mf.prunable(self.root, self.keep, verified=self._remember)
            except OSError:
                return  # the folder is unreadable now; the next commit tries again
            mf.remove(doomed)
            if doomed:
                self.say(f"removed {', '.join(d.name for d in doomed)} (keeping the newest "
                         f"{self.keep} verified)")

        # not a daemon: the interpreter waits for it at exit
        self._pruner = threading.Thread(target=prune, name="ckpt-prune")
        self._pruner.start()

    def join_prune(self) -> None:
        pruner, self._pruner = getattr(self, "_pruner", None), None
        if pruner is not None:
            pruner.join()

    def _failed(self, step: int, path: Path, err: BaseException,
                reason: str = "interval") -> None:
        """A save that did not commit: report it in one line, drop its folder, train on."""
        line = one_line(err)
        self.stats["failed"].append({"step": step, "error": line})
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            last = mf.step_name(self.last_committed) if self.last_committed is not None else "none"
            self.say(f"save of {path.name} FAILED ({line}); "
                     + ("" if reason == "final" else "training goes on, ")
                     + f"last committed checkpoint: {last}")
            self.event("save_failed", step=step, error=line, last_committed=self.last_committed)
