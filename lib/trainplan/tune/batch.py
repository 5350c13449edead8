"""The search with several trials a launch: `trainplan tune --search-batch K`.

Each round asks Optuna for up to K runnable configs and runs them one after another in one
sweep launch (`trainplan.bench.series.sweep`), then tells each its figure. A launch's start
(torchrun, imports, process group: most of a small model's launch) is paid once a round
instead of once a trial; a sweep's runs time as separate launches do
(`data/measurements/sweep-ab-h200x2-20261128/`).

- NCCL reads its environment when the launch makes its communicators, so one launch holds
  configs of one NCCL setting: a config asked with another waits for the next round.
- Successive halving as in `trainplan.tune.loop`: after its first run a trial reports its
  figure at resource 1; one the pruner promotes gets its replicate in the next round
  (first in it), and is told when that is in, or when the study stops without it.
- Spend: the launch's wall time x GPUs, shared by its runs: each its own time plus an equal
  share of the start, written to each trial as the launch goes (`gpu_seconds`), so a killed
  study keeps it counted (`study.recover`). A round takes only the runs that the medians of
  earlier runs and starts say fit the budget and --stop-after-s.
- A run that fails (its error line) fails its trial as a failed launch does; a launch that
  dies fails the trial it was running; the trials it did not reach go to the next round.

One group of GPUs (`--workers 1`).
"""

from __future__ import annotations

import statistics
import time

from trainplan.tune import knobs
from trainplan.tune import trial as tl


def _prices(run) -> tuple[float, float]:
    """(a launch's start, a run inside a launch) in GPU-seconds: medians of this study's
    rounds; before any, no start and a whole launch a run (the one-trial launches' median)."""
    trials = run["study"].get_trials(deepcopy=False)
    inside = [c for t in trials for c in t.user_attrs.get("run_gpu_seconds", []) if c > 0]
    starts = [s for t in trials for s in t.user_attrs.get("start_gpu_seconds", [])]
    if inside:
        return (statistics.median(starts) if starts else 0.0), statistics.median(inside)
    launches = [c for t in trials for c in t.user_attrs.get("launch_gpu_seconds", [])]
    return 0.0, (statistics.median(launches) if launches else 0.0)


def _room(run, runs: int) -> str | None:
    """Why a launch of `runs` runs may not start now (budget, time), or None."""
    start, each = _prices(run)
    cost = start + runs * each
    if run["spend"].total() + cost > run["budget_s"]:
        return "budget"
    stop = run["stop_after_s"]
    if stop and time.monotonic() - run["start"] + cost / run["suite"]["gpus"] > stop:
        return "time"
    return None


class Job:
    """One trial in the rounds: its config, figures so far and spend."""

    def __init__(self, trial, cfg: dict):
        self.trial, self.cfg, self.summaries, self.costs, self.runs = trial, cfg, [], [], 0
        self.used = float(trial.user_attrs.get("gpu_seconds", 0.0))

    @property
    def env(self) -> tuple:
        return tuple(sorted((k, v or "") for k, v in knobs.env(self.cfg).items()))


def run_batches(run, devices: str | None, k: int) -> None:
    """The search in rounds of up to `k` runs, until a limit; sets run["stopped"]. `run` is
    `trainplan.tune.loop`'s, with its `why_stop`, `settle`, `note` and `show`."""
    from optuna.trial import TrialState

    study, spend, suite = run["study"], run["spend"], run["suite"]
    waiting: list[Job] = []  # replicates promoted, configs of another NCCL setting, re-runs
    while run["stopped"] is None or waiting:
        batch = [j for j in waiting if j.env == waiting[0].env][:k] if waiting else []
        while batch and _room(run, len(batch)):
            batch.pop()  # the waiting take only what fits
        if waiting and not batch:
            run["stopped"] = run["stopped"] or _room(run, 1)
            for job in waiting:  # no room even for one: tell what they have
                _finish(run, job, TrialState)
            return
        while run["stopped"] is None and len(batch) < k:
            why = run["why_stop"](run) or _room(run, len(batch) + 1)
            if why:
                if not batch:
                    run["stopped"] = why
                break
            run["proposals"] += 1
            trial = study.ask()
            cfg = knobs.suggest(trial, run["space"], world=suite["gpus"],
                                dp=suite["layout"].get("dp", 1), data=knobs.data_source(suite))
            trial.set_user_attr("config", cfg)
            trial.set_user_attr("devices", devices or "cpu")
            if run["settle"](run, trial, cfg, TrialState) is None:
                continue
            job = Job(trial, cfg)
            spend.running += 1
            (batch if not batch or job.env == batch[0].env else waiting).append(job)
        if not batch:
            return
        waiting = [j for j in waiting if j not in batch]
        waiting[:0] = _round(run, batch, devices, TrialState)
        run["show"](run)


def _entries(run, batch: list[Job]) -> list[dict]:
    out = []
    for job in batch:
        launch = job.runs  # its runs so far that printed a line
        args = tl.train_args(run["suite"], job.cfg, run["cpu"])
        if not run["cpu"]:
            args += ["--records", str(run["rec_path"]), "--run-id",
                     f"{run['name']}/trial-{job.trial.number}/launch-{launch}"]
        out.append({"tag": f"trial-{job.trial.number}/launch-{launch}", "args": args})
    return out


def _round(run, batch: list[Job], devices: str | None, TrialState) -> list[Job]:
    """Run `batch` in one sweep launch and settle each trial; the jobs for the next round."""
    suite, spend, gpus = run["suite"], run["spend"], run["suite"]["gpus"]
    env = tl.launch_env(batch[0].cfg)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    entries = _entries(run, batch)

    def tick(elapsed):
        for job in batch:  # an equal share each until the lines say who took what
            cost = job.used + elapsed * gpus / len(batch)
            job.trial.set_user_attr("gpu_seconds", cost)
            spend.set(job.trial.number, cost)
        if spend.total() > run["budget_s"]:
            return "budget"
        stop = run["stop_after_s"]
        return "time" if stop and time.monotonic() - run["start"] > stop else None

    by_tag, start, error, _ = tl.sweep_launch(suite, entries, env, tick=tick)
    stopped = tl.stop_reason(error)
    if stopped and run["stopped"] is None:
        run["stopped"] = stopped
    nxt, crashed = [], False
    for job, entry in zip(batch, entries, strict=True):
        line = by_tag.get(entry["tag"])
        job.runs += line is not None
        cost = start / len(batch) + (float(line["elapsed_s"]) * gpus if line else 0.0)
        job.used += cost
        job.costs.append(cost)
        t = job.trial
        t.set_user_attr("gpu_seconds", job.used)
        spend.set(t.number, job.used)
        t.set_user_attr("run_gpu_seconds", [*t.user_attrs.get("run_gpu_seconds", []),
                                            cost - start / len(batch)])
        t.set_user_attr("start_gpu_seconds", [*t.user_attrs.get("start_gpu_seconds", []),
                                              start])
        run["note"](run["log"], trial=t.number, launch=job.runs - 1, sweep=entry["tag"],
             seconds=round(cost / gpus, 2), config=job.cfg, devices=devices,
             rate=line and line.get("summary", {}).get("tokens_per_s_per_gpu"),
             error=(line or {}).get("error") or (None if line else error or "not reached"))
        if line and "summary" in line:
            job.summaries.append(line["summary"])
            fig = tl.pooled(job.summaries)
            t.report(fig["tokens_per_s_per_gpu"], len(job.summaries))
            if len(job.summaries) < suite["max_launches"] and not t.should_prune() \
                    and not stopped:
                nxt.append(job)  # promoted: a replicate next round
            else:
                _finish(run, job, TrialState)
        elif job.summaries:  # a replicate that failed or was cut: its first figure stands
            t.set_user_attr("replicate_error", (line or {}).get("error") or error)
            _finish(run, job, TrialState)
        elif (line and "error" in line) or (not stopped and not crashed):
            t.set_user_attr("failed", (line or {}).get("error") or error)
            t.set_constraint("runnable", 1.0)
            run["study"].tell(t, state=TrialState.PRUNED)
            spend.running -= 1
            crashed = crashed or line is None
        elif stopped:
            t.set_user_attr("interrupted", f"stopped: {stopped}")
            run["study"].tell(t, state=TrialState.FAIL)
            spend.running -= 1
        else:
            nxt.append(job)  # the launch died before it: run it in the next round
    return nxt


def _finish(run, job: Job, TrialState) -> None:
    """Tell a trial its pooled figure (or, with none, that it was interrupted)."""
    t = job.trial
    if not job.summaries:
        t.set_user_attr("interrupted", f"stopped: {run['stopped'] or 'budget'}")
        run["study"].tell(t, state=TrialState.FAIL)
    else:
        for key, value in tl.pooled(job.summaries).items():
            t.set_user_attr(key, value)
        t.set_user_attr("launches", len(job.summaries))
        t.set_user_attr("launch_gpu_seconds", job.costs)
        t.set_user_attr("measured", True)
        run["study"].tell(t, t.user_attrs["tokens_per_s_per_gpu"])
    run["spend"].running -= 1
