"""The knob study's loop: ask Optuna for a config, launch it, tell the result; N at a time.

`run_study` runs `workers` threads. Each owns a disjoint group of the
machine's GPUs (`tune_launch.device_groups`: CUDA_VISIBLE_DEVICES of its
launches) and repeats: ask, skip what the planner rules out, launch,
successive halving decides on a replicate, tell. On a 4-GPU host a 2-GPU
study runs two launches at once, as Optuna's distributed optimisation does
with one storage and several workers; the GPUs, their NVLink pairs and 16+
CPU cores each are not shared, the host's memory bus and disk are. The
study records which group ran each trial (`devices`) and how many ran at
once (`workers`), and `tune --report` says so.

Budget: the spend of all workers is one sum (`Spend`), updated every
heartbeat of every launch, so a launch is not started when the median
launch, times the launches already under way plus this one, would overrun
it, and a running launch is stopped when the total does. `--stop-after-s`
is checked the same way, in wall time.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

from trainplan.tune import knobs
from trainplan.tune import study as tn
from trainplan.tune import trial as tl
from trainplan.tune.batch import run_batches


class Spend:
    """GPU-seconds of the study: earlier runs' (from storage) plus this run's, per trial."""

    def __init__(self, before: float):
        self.before, self.lock, self.trials, self.running = before, threading.Lock(), {}, 0

    def set(self, number: int, seconds: float) -> None:
        with self.lock:
            self.trials[number] = seconds

    def total(self) -> float:
        with self.lock:
            return self.before + sum(self.trials.values())


def _log(path: Path, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields})
                + "\n")


def _duplicate(study, cfg: dict, number: int):
    for t in tn.measured(study):
        if t.user_attrs.get("config") == cfg and t.number != number:
            return t
    return None


def run_study(suite: dict, *, storage: str, name: str, gpu_hours: float, trials: int,
              cpu: bool = False, records_path: str | None = None,
              stop_after_s: float | None = None, progress: bool = True,
              workers: int = 1, batch: int = 1) -> dict:
    """Run (or resume) the study until `trials` configs are measured or a limit stops it;
    `batch` > 1: up to that many trials a launch (`trainplan.tune.batch`, one worker)."""
    from tqdm import tqdm

    card = tl.card_name(cpu)  # before the storage: a bad request writes nothing
    gpu = tl.gpu_for(card, suite)
    groups = tl.device_groups(workers, suite["gpus"], cpu)
    store, path = tn.open_storage(storage, must_exist=False)
    budget_s = gpu_hours * 3600.0
    run = {"suite": suite, "gpu": gpu, "cpu": cpu, "budget_s": budget_s, "name": name,
           "start": time.monotonic(), "stop_after_s": stop_after_s, "trials": trials,
           "log": path.with_name(path.stem + ".log"), "lock": threading.Lock(),
           "stopped": None, "proposals": 0, "tl": tl,
           "rec_path": Path(records_path) if records_path else path.with_name(
               path.stem + "-measurements.jsonl")}
    with tn.exclusive(path):
        study = tn.load_study(store, name, suite, create=True)
        recovered = tn.recover(study)
        run.update(study=study, space=knobs.space(suite["space"]),
                   spend=Spend(tn.gpu_seconds(study)))
        study.set_user_attr("budget_gpu_hours", gpu_hours)
        study.set_user_attr("card", card)
        study.set_user_attr("workers", max(workers, study.user_attrs.get("workers", 1)))
        first = len(tn.measured(study))
        run["bar"] = tqdm(total=trials, initial=min(first, trials), desc=f"tune {name}",
                          file=sys.stderr, disable=not progress, unit="config")
        if batch > 1:
            run.update(why_stop=_why_stop, settle=_settle, note=_log, show=_show)
            run_batches(run, groups[0], batch)
        else:
            threads = [threading.Thread(target=_worker, args=(run, g), daemon=True)
                       for g in groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        run["bar"].close()
        done = tn.measured(study)
        spent_h = tn.gpu_seconds(study) / 3600.0
    stopped = run["stopped"]
    messages = {
        "trials": f"done: {len(done)} configurations measured (target {trials})",
        "budget": f"stopped: GPU-hour budget spent ({spent_h:.3f} of {gpu_hours:g} GPU-hours; "
                  "the next launch would overrun it)",
        "time": f"stopped: --stop-after-s {stop_after_s:g} reached; rerun the same command to "
                "resume" if stop_after_s else "",
        "space": "stopped: the sampler keeps proposing skipped or measured configs; the space "
                 "is exhausted",
    }
    best = max(done, key=lambda t: t.value, default=None)
    return {"study": name, "storage": str(path), "stopped": stopped, "message": messages[stopped],
            "trials": len(done), "new_trials": len(done) - first, "recovered": recovered,
            "gpu_hours": spent_h, "budget_gpu_hours": gpu_hours, "card": card,
            "workers": workers,
            "best": None if best is None else {
                "trial": best.number, "config": best.user_attrs["config"],
                "tokens_per_s_per_gpu": best.value, "ci": best.user_attrs["ci"]}}


def _why_stop(run) -> str | None:
    """The limit that forbids starting one more launch now (called under run["lock"])."""
    study, spend, suite = run["study"], run["spend"], run["suite"]
    costs = [c for t in study.get_trials(deepcopy=False)
             for c in t.user_attrs.get("launch_gpu_seconds", [])]
    expected = statistics.median(costs) if costs else 0.0
    wall = expected / suite["gpus"]
    if len(tn.measured(study)) + spend.running >= run["trials"]:
        return "trials"
    if spend.total() + expected * (spend.running + 1) > run["budget_s"]:
        return "budget"
    if run["stop_after_s"] and time.monotonic() - run["start"] + wall > run["stop_after_s"]:
        return "time"
    if run["proposals"] >= 20 * run["trials"]:
        return "space"
    return None


def _worker(run, devices: str | None) -> None:
    """One worker: ask, skip or launch on its GPUs, tell; until a limit or another worker's
    stop. Only the launch itself runs outside the lock."""
    from optuna.trial import TrialState

    study, spend = run["study"], run["spend"]
    while True:
        with run["lock"]:
            if run["stopped"] is None:
                why = _why_stop(run)
                if why and spend.running and why in ("trials", "space"):
                    why = "wait"  # another worker's launch may still fail: it decides
                if why != "wait":
                    run["stopped"] = why
            if run["stopped"]:
                return
            if why == "wait":
                trial = None
            else:
                run["proposals"] += 1
                trial = study.ask()
                cfg = knobs.suggest(trial, run["space"], world=run["suite"]["gpus"],
                                    dp=run["suite"]["layout"].get("dp", 1),
                                    data=knobs.data_source(run["suite"]))
                trial.set_user_attr("config", cfg)
                trial = _settle(run, trial, cfg, TrialState)
                if trial is not None:
                    spend.running += 1
        if trial is None:
            time.sleep(0.5 if why == "wait" else 0)
            continue
        trial.set_user_attr("devices", devices or "cpu")
        outcome = _measure(run, trial, cfg, devices)
        with run["lock"]:
            spend.running -= 1
            if outcome in ("budget", "time") and run["stopped"] is None:
                run["stopped"] = outcome
            _show(run)


def _show(run) -> None:
    """The progress bar: configurations measured, the best figure, GPU-hours spent."""
    measured = tn.measured(run["study"])
    bar = run["bar"]
    bar.n = min(len(measured), run["trials"])
    best = max((t.value for t in measured), default=None)
    bar.set_postfix(best=f"{best:,.0f}" if best else "-",
                    gpu_h=f"{run['spend'].total() / 3600:.3f}/{run['budget_s'] / 3600:g}")
    bar.refresh()


def _settle(run, trial, cfg, TrialState):
    """Tell a trial that needs no launch (skipped by the planner, or a config measured before)
    and return None; else return the trial to launch."""
    study = run["study"]
    reason = knobs.skip_reason(cfg, run["suite"], run["gpu"])
    if reason:
        trial.set_user_attr("skipped", reason)
        trial.set_constraint("runnable", 1.0)  # infeasible: TPE learns to avoid it
        study.tell(trial, state=TrialState.PRUNED)
        _log(run["log"], trial=trial.number, skipped=reason)
        return None
    dup = _duplicate(study, cfg, trial.number)
    if dup is not None:
        trial.set_user_attr("duplicate_of", dup.number)
        study.tell(trial, dup.value)
        return None
    return trial


def _measure(run, trial, cfg, devices: str | None) -> str:
    """Launch the config (successive halving decides on a second launch); tell the study."""
    from optuna.trial import TrialState

    suite, tl, spend, study = run["suite"], run["tl"], run["spend"], run["study"]
    gpus, budget_s, stop_after_s = suite["gpus"], run["budget_s"], run["stop_after_s"]
    summaries, launch_costs, used, result = [], [], 0.0, "ok"
    env = tl.launch_env(cfg)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    cmd = tl.launch_command(suite, cfg, run["cpu"])

    for launch in range(suite["max_launches"]):
        if launch:  # a replicate only where budget and time allow: else keep the figure so far
            nxt = statistics.median(launch_costs)
            late = stop_after_s and time.monotonic() - run["start"] + nxt / gpus > stop_after_s
            if spend.total() + nxt > budget_s or late:
                break

        def tick(elapsed, used=used):
            cost = used + elapsed * gpus
            trial.set_user_attr("gpu_seconds", cost)
            spend.set(trial.number, cost)
            if spend.total() > budget_s:
                return "budget"
            if stop_after_s and time.monotonic() - run["start"] > stop_after_s:
                return "time"
            return None

        run_cmd = cmd if run["cpu"] else [
            *cmd, "--records", str(run["rec_path"]),
            "--run-id", f"{run['name']}/trial-{trial.number}/launch-{launch}"]
        summary, error, seconds = tl.run_launch(run_cmd, env, tick=tick,
                                                deadline_s=suite["launch_timeout_s"])
        used += seconds * gpus
        launch_costs.append(seconds * gpus)
        spend.set(trial.number, used)
        trial.set_user_attr("gpu_seconds", used)
        trial.set_user_attr("launch_gpu_seconds", launch_costs)
        _log(run["log"], trial=trial.number, launch=launch, seconds=round(seconds, 2),
             config=cfg, devices=devices, rate=summary and summary["tokens_per_s_per_gpu"],
             error=error or None)
        if summary is None:
            if summaries:  # a replicate cut short or crashed: keep the first launch's figure
                trial.set_user_attr("replicate_error", error)
                result = error.split(": ")[1] if error.startswith("stopped") else "ok"
                break
            if error.startswith("stopped"):
                trial.set_user_attr("interrupted", error)
                study.tell(trial, state=TrialState.FAIL)
                return error.split(": ")[1]
            trial.set_user_attr("failed", error)
            trial.set_constraint("runnable", 1.0)
            study.tell(trial, state=TrialState.PRUNED)
            return "failed"
        summaries.append(summary)
        figure = tl.pooled(summaries)
        trial.report(figure["tokens_per_s_per_gpu"], launch + 1)  # resource: launches done
        if launch + 1 < suite["max_launches"] and trial.should_prune():
            break  # not promoted: one launch is its figure
    for key, value in figure.items():
        trial.set_user_attr(key, value)
    trial.set_user_attr("launches", len(summaries))
    trial.set_user_attr("measured", True)
    study.tell(trial, figure["tokens_per_s_per_gpu"])
    return result


def run_stages(suite: dict, *, storage: str, name: str, gpu_hours: float, trials: int,
               effects_share: float = 0.0, effects: dict | None = None, cpu: bool = False,
               records_path: str | None = None, stop_after_s: float | None = None,
               progress: bool = True, workers: int = 1, batch: int = 1) -> dict:
    """The search, then the effects stage (`trainplan.tune.effects`), under one budget.

    The search may spend (1 - `effects_share`) of `gpu_hours`, less what the effects stage
    has spent already; the effects stage gets the rest of `gpu_hours` once the search has
    stopped for its budget, its trial count or its space (not for --stop-after-s: the next
    call resumes the search first). `effects_share` 0: the search alone; 1: the effects
    stage alone, around --base plan, a trial, or the best of an earlier search. `effects`:
    the keyword arguments of `effects.run_effects` (base, halfwidth, knob_names, max_pairs).
    """
    from trainplan.tune import effects as fx

    start = time.monotonic()
    out: dict = {"study": name, "storage": storage, "search": "skipped (--effects-share 1)"}
    if effects_share < 1.0:
        done = fx.read_records(fx.paths(tn.storage_path(storage)[1])[0])
        spent_h = sum(float(r.get("gpu_seconds", 0.0)) for r in done if r["study"] == name) / 3600
        search_h = min((1.0 - effects_share) * gpu_hours, gpu_hours - spent_h)
        if search_h > 0:
            out = run_study(suite, storage=storage, name=name, gpu_hours=search_h, trials=trials,
                            cpu=cpu, records_path=records_path, stop_after_s=stop_after_s,
                            progress=progress, workers=workers, batch=batch)
        if effects_share == 0.0 or out.get("stopped") == "time":
            return out
    left = None if stop_after_s is None else max(stop_after_s - (time.monotonic() - start), 1e-3)
    out["effects"] = fx.run_effects(suite, storage=storage, name=name, gpu_hours=gpu_hours,
                                    cpu=cpu, records_path=records_path, stop_after_s=left,
                                    progress=progress, **(effects or {}))
    return out
