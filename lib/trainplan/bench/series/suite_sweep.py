"""Sweep mode of a measurement suite (`suite --sweep`, `trainplan validate --sweep`).

Each of the `--launches` repetitions is one torchrun launch per GPU count
(`trainplan.bench.series.sweep`) that runs all of that count's configs in turn, each
with its own warm-up dropped and its own measurement record (train.py's, with
"sweep launch: position P of N" in `notes`). Repetition k starts the list at
offset k, so that being first (or last) in a process falls on every config
in turn. Predictions are recorded before, by the caller, as for separate
launches.

Failures: a config that the sweep reports as failed (TrainplanError, out of
memory) goes to DIR/failed.jsonl and is not run again; the others go on. A
launch that crashes or runs past its limit is stopped with its whole process
tree (`suite.run_group`); the config it was running is recorded as failed,
and the configs it did not reach are launched again in a fresh sweep if the
budget allows, else recorded as failed with that reason.

Budget: a config is taken only if all its repetitions fit, priced at the
longest time it (else any config) took inside a sweep, CONFIG_GUESS_S before
any, plus a launch's start (the launch's time less its configs', the longest
seen; START_GUESS_S before any). The configs taken run in rounds: when a
round ends, the configs not yet taken are priced again with what its launches
took, and those that now fit run in the next, so guesses that were too long do
not leave the budget unspent (data/measurements/validate-h200x4-20261128/). A
launch that no longer fits drops configs from the end of the suite's order; its
time limit is twice its estimate plus a minute, within what is left (all that is
left for the first launch, whose compiles are cold).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from trainplan.bench.flags import ENTRIES, harness_entry
from trainplan.bench.series import suite as suite_mod
from trainplan.errors import SpecError

START_GUESS_S = 25.0  # torchrun, imports, process group (H200 x 2: ~20 s of a 25 s launch)
CONFIG_GUESS_S = 20.0  # one config inside a sweep: build, compile, warm-up and timed steps


class Budget:
    """What launches and configs took so far, and the estimates made from it."""

    def __init__(self):
        self.start: float | None = None  # longest launch start seen
        self.config: dict[str, float] = {}  # tag -> longest time inside a sweep

    def of(self, tag: str) -> float:
        return self.config.get(tag) or max(self.config.values(), default=CONFIG_GUESS_S)

    def launch(self, tags: list[str]) -> float:
        return (self.start or START_GUESS_S) + sum(self.of(t) for t in tags)

    def limit(self, tags: list[str], left: float) -> float:
        return left if self.start is None else min(left, 2 * self.launch(tags) + 60.0)

    def saw(self, took: float | None, lines: list[dict]) -> None:
        """A launch's config lines, and its time if it ran to the end (else None)."""
        for line in lines:
            self.config[line["tag"]] = max(self.config.get(line["tag"], 0.0), line["elapsed_s"])
        if took is not None:
            self.start = max(self.start or 0.0, took - sum(ln["elapsed_s"] for ln in lines))


def measure_sweep(jobs, preds: dict, out: Path, run_id: str, launches: int, deadline: float):
    """`suite.measure`'s job (same arguments, same results) in sweep launches."""
    sweep_only(jobs)
    sw = Sweep(jobs, out, run_id, launches, deadline)
    taken: set[str] = set()
    while more := choose([j for j in jobs if j[1]["tag"] not in taken], launches, sw.budget,
                         sw.left()):
        taken.update(more)
        sw.round(more)
    rows = [(t, preds[t]["predicted"], sw.state[t]["done"]) for t in sw.order]
    outcomes = [{"tag": t, "gpus": sw.cfg(t)["gpus"], "layout": suite_mod.full_layout(sw.cfg(t)),
                 "compile": bool(sw.cfg(t).get("compile", False)), "status": sw.state[t]["status"],
                 "launches": len(sw.state[t]["done"]), "reason": sw.state[t]["reason"]}
                for t in sw.order]
    return rows, outcomes


def sweep_only(jobs) -> None:
    """Refuse (one line) a config whose implementation runs its own loop (Trainer): a sweep
    launch runs train.py's loop config after config."""
    for _, cfg in jobs:
        if cfg.get("impl", "trainplan") in ENTRIES:
            raise SpecError(f"config {cfg['tag']}: impl {cfg['impl']} runs its own loop, one "
                            "launch a config; leave out --sweep")


def choose(jobs, launches: int, budget: Budget, left: float) -> list[str]:
    """The configs, in the suite's order, of which all repetitions fit in `left` seconds."""
    chosen, need, counts = [], 0.0, set()
    for _, cfg in jobs:
        start = 0.0 if cfg["gpus"] in counts else (budget.start or START_GUESS_S)
        extra = launches * (budget.of(cfg["tag"]) + start)
        if need + extra > left:
            break
        chosen.append(cfg["tag"])
        need += extra
        counts.add(cfg["gpus"])
    return chosen


class Sweep:
    """The configs' state through a series of sweep launches."""

    def __init__(self, jobs, out: Path, run_id: str, launches: int, deadline: float):
        self.jobs = {cfg["tag"]: (s, cfg) for s, cfg in jobs}
        self.order = [cfg["tag"] for _, cfg in jobs]
        self.out, self.run_id, self.launches, self.deadline = out, run_id, launches, deadline
        self.env = {**os.environ, **suite_mod.NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
        self.budget = Budget()
        self.state = {t: {"done": [], "status": "not run", "live": False,
                          "reason": "time budget spent before it started"} for t in self.order}

    def cfg(self, tag: str) -> dict:
        return self.jobs[tag][1]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def round(self, tags: list[str]) -> None:
        """All repetitions of `tags`: per repetition, one launch per GPU count."""
        groups: dict[int, list[str]] = {}
        for tag in tags:
            self.state[tag]["live"] = True
            groups.setdefault(self.cfg(tag)["gpus"], []).append(tag)
        for rep in range(self.launches):
            for group in groups.values():
                live = [t for t in group if self.state[t]["live"]]
                k = rep % len(live) if live else 0
                todo = live[k:] + live[:k]  # repetition k starts at offset k
                while todo:
                    todo = self.fit(todo)
                    if todo:
                        todo = self.launch(todo, rep)

    def fit(self, todo: list[str]) -> list[str]:
        """`todo` less the configs, latest in the suite first, that put the launch over the
        budget; those run no more."""
        todo = list(todo)
        while todo and self.budget.launch(todo) > self.left():
            last = max(todo, key=self.order.index)
            todo.remove(last)
            self.stop(last)
        return todo

    def stop(self, tag: str) -> None:
        st = self.state[tag]
        st["live"] = False
        if st["done"]:
            st["reason"] = f"time budget spent after {len(st['done'])} launch(es)"

    def launch(self, todo: list[str], rep: int) -> list[str]:
        """One sweep launch of `todo`; returns the configs to launch again (those it did not
        reach when it crashed or was stopped, if they fit), or []."""
        runs = []
        for tag in todo:
            s, cfg = self.jobs[tag]
            _, impl = harness_entry(cfg.get("impl", "trainplan"))  # train.py's (sweep_only)
            runs.append({"tag": tag, "args": [*suite_mod.train_args(s, cfg, self.out, self.run_id),
                                              *impl]})
        limit = self.budget.limit(todo, self.left())
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp) / "runs.json"
            spec.write_text(json.dumps(runs))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={self.cfg(todo[0])['gpus']}", "-m",
                   "trainplan.bench.series.sweep", str(spec)]
            t0 = time.monotonic()
            rc, stdout, stderr = suite_mod.run_group(cmd, self.env, limit)
            took = time.monotonic() - t0
        lines = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith('{"tag"')]
        self.budget.saw(took if rc == 0 else None, lines)
        for line in lines:
            where = f"sweep position {line['position']} of {len(todo)}"
            if "summary" in line:
                st = self.state[line["tag"]]
                st["done"].append(line["summary"])
                st["status"], st["reason"] = "measured", None
                print(f"{self.name(line['tag'], rep)}: "
                      f"{line['summary'].get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU "
                      f"({where}, {line['elapsed_s']:.0f} s)", flush=True)
            else:
                self.fail(line["tag"], rep, f"{line['error']} ({where})")
        missing = [t for t in todo if t not in {line["tag"] for line in lines}]
        if not missing:
            return []
        why = (f"sweep launch stopped at its time limit after {limit:.0f} s" if rc is None
               else "sweep launch " + suite_mod.failure_reason(rc, stderr or stdout))
        running, rest = missing[0], missing[1:]
        log = None
        if rc is not None:  # the traceback behind `why`, beside the running config's record
            log = suite_mod.failure_log(self.out, running, rep + 1)
            suite_mod.write_log(log, stderr or stdout)
        self.fail(running, rep, f"{why}, while this config ran", log=log)
        if rest and self.budget.launch(rest) <= self.left():
            return rest
        for tag in rest:
            s, cfg = self.jobs[tag]
            suite_mod.record_failure(self.out, s, cfg, rep + 1, f"not reached: {why}, while "
                                     f"{running} ran; no time left to launch it again",
                                     self.run_id)
            self.stop(tag)
        return []

    def fail(self, tag: str, rep: int, reason: str, log: Path | None = None) -> None:
        """A config failed in a sweep: a line in failed.jsonl (naming `log`, the launch's
        output, where one was written), and it runs no more (as with separate launches)."""
        print(f"{self.name(tag, rep)}: FAILED ({reason})", flush=True)
        st = self.state[tag]
        st["status"] = "measured" if st["done"] else "failed"
        st["reason"], st["live"] = reason, False
        s, cfg = self.jobs[tag]
        suite_mod.record_failure(self.out, s, cfg, rep + 1, reason, self.run_id, log=log)

    def name(self, tag: str, rep: int) -> str:
        number = f"[{self.order.index(tag) + 1}/{len(self.order)}]"
        return f"{number} {tag} launch {rep + 1}/{self.launches}"
