"""The knob study: Optuna over `trainplan.knobs`, each trial a real harness launch, under a budget.

    trainplan tune --suite data/suites/tune-2gpu.yaml --storage PATH.journal \\
        --gpu-hours 0.5 --trials 48 [--stop-after-s 540] [--cpu]

Storage: a journal file (`journal:PATH`, or any path not ending in .db /
.sqlite) or SQLite (`sqlite:///PATH`); the study is created with
`load_if_exists`, so rerunning the same command resumes it. `--trials` is the
study's total of measured configurations and `--gpu-hours` its total budget,
both counted from storage, so a resumed study goes on where it stopped.

Budget: every launch's whole wall time x its GPUs (ranks on the CPU proxy)
counts, start-up, warm-up and compile included. The spend is written to the
trial every few seconds (`tune_launch.HEARTBEAT_S`), so a killed study loses at most that much
of its accounting; its RUNNING trial is marked FAIL ("interrupted") on the
next start. A launch is not started when the median launch so far would
overrun the budget, and is killed if it does overrun; the study then stops
and says so. One process per storage at a time (a lock file next to it).

Sampler: `TPESampler(multivariate=True, group=True)` with constraints.
The space is small, mostly categorical, conditional (prefetch only with
workers) and noisy. TPE models categorical and integer knobs natively
(Bergstra et al. 2011, NeurIPS, "Algorithms for Hyper-Parameter
Optimization"); multivariate TPE models their interactions (micro-batch x
recompute x ZeRO share one memory budget; Falkner et al. 2018, BOHB);
`group=True` gives the conditional prefetch knob its own subspace; TPE
splits trials by rank quantile, not by value, so noise of a few percent moves
it little (Watanabe 2023, arXiv:2304.11127). GP and CMA-ES samplers handle
categorical knobs poorly. Skipped and crashed configs count as infeasible
(`Trial.set_constraint` > 0), so TPE learns to avoid them without a made-up
objective value.
The first `n_startup` trials are random (a space-filling start).

Pruner: successive halving over launches (Jamieson and Talwalkar 2016;
Li et al. 2017, Hyperband). Every config gets one launch; only those in the
top 1/`reduction_factor` at that rung get a second, fresh launch, which
replicates the best configs (launch-to-launch noise) instead of spending the
budget on configs that are plainly slower. A config not promoted keeps its
one-launch figure and ends COMPLETE: nothing measured is thrown away.

Objective: tokens/s/GPU, total tokens over total time of the kept steps
(windows) of all launches, warm-up steps dropped, with a bootstrap 95%
interval over windows (`trainplan.stats.rate_ci`), stored as user attrs.
GPU launches also append a measurement record (`--records`, written by the
harness itself, so its provenance carries the launch's own NCCL
environment); its run_id `STUDY/trial-N/launch-K` points to the trial,
whose user attrs hold the full knob config.

The GPU study (2 GPUs). A device command may run 10 minutes, so the study is
one command that stops itself at `--stop-after-s` and resumes from its
storage on the next call; two calls spend the 0.5 GPU-hour budget (about
35-40 launches of ~25 s: ~30 configurations plus replicates of the best):

    mkdir -p $OUT/tune /tmp/site && (cp data/measurements/tune-2gpu/* $OUT/tune/ \
      2>/dev/null; true) && cp -r .venv/lib/python3.11/site-packages/optuna \
      .venv/lib/python3.11/site-packages/colorlog /tmp/site/ && export \
      PYTHONPATH=$PWD/lib:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
      TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 && python3 -m trainplan.cli \
      tune --suite data/suites/tune-2gpu.yaml --storage $OUT/tune/study.journal \
      --records $OUT/tune/measurements.jsonl --gpu-hours 0.5 --trials 48 \
      --stop-after-s 530 --json

run with kind nvidia-h100-x2 (or nvidia-h200-x2), timeout_s 600, carry
[".venv/lib/python3.11/site-packages/optuna",
".venv/lib/python3.11/site-packages/colorlog"] (optuna and colorlog are pure
Python and absent there; the journal storage needs no SQLAlchemy). After each
call copy the returned tune/* files into data/measurements/tune-2gpu/, then
call again until it prints "stopped: GPU-hour budget spent" or "done".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import yaml

from trainplan import knobs
from trainplan.errors import SpecError, TrainplanError

SUITE_DEFAULTS = {"cluster": "dgx-h100", "gpu": "h100-sxm", "seq_len": 2048, "warmup": 3,
                  "windows": 10, "target_sequences": 160, "max_measure_s": 25.0,
                  "max_launches": 2, "reduction_factor": 4, "n_startup": 10, "seed": 0,
                  "launch_timeout_s": 300.0, "extra_args": [], "space": {}}


class StudyError(TrainplanError):
    """A study that cannot be run or read (storage, suite, another process holding it)."""


# ---------------------------------------------------------------- suite and storage


def make_suite(*, suite_path: str | None = None, model: str | None = None, gpus: int = 1,
               seq_len: int | None = None) -> dict:
    """A tune suite from a YAML file, or from --model/--gpus (data parallel over all GPUs)."""
    if suite_path:
        try:
            raw = yaml.safe_load(Path(suite_path).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise SpecError(f"--suite {suite_path}: cannot read "
                            f"({' '.join(str(err).split())[:160]})") from None
        if not isinstance(raw, dict) or "model" not in raw or "gpus" not in raw:
            raise SpecError(f"--suite {suite_path}: expected a mapping with 'model' and 'gpus'")
    else:
        raw = {"model": model, "gpus": gpus}
    suite = {**SUITE_DEFAULTS, **raw}
    if seq_len:
        suite["seq_len"] = seq_len
    suite.setdefault("layout", {"dp": suite["gpus"]})
    unknown = set(suite["layout"]) - {"dp", "tp", "pp"}
    if unknown or suite["layout"].get("dp", 1) * suite["layout"].get("tp", 1) * \
            suite["layout"].get("pp", 1) != suite["gpus"]:
        raise SpecError(f"suite layout {suite['layout']} must give dp x tp x pp = gpus "
                        f"{suite['gpus']} (keys dp, tp, pp)")
    from trainplan.specs import load_cluster, load_model
    load_model(suite["model"]), load_cluster(suite["cluster"])  # a bad preset fails here
    knobs.space(suite["space"])
    return suite


def storage_path(spec: str) -> tuple[str, Path]:
    """('journal' | 'sqlite', file path) of a --storage value."""
    if spec.startswith("sqlite:///"):
        return "sqlite", Path(spec[len("sqlite:///"):])
    path = Path(spec[len("journal:"):] if spec.startswith("journal:") else spec)
    kind = "sqlite" if path.suffix in (".db", ".sqlite", ".sqlite3") else "journal"
    return kind, path


def open_storage(spec: str, *, must_exist: bool):
    kind, path = storage_path(spec)
    if must_exist and not path.is_file():
        raise StudyError(f"--storage {spec}: no study there (no file {path})")
    if not path.parent.is_dir():
        raise StudyError(f"--storage {spec}: folder {path.parent} does not exist")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if kind == "sqlite":
        return optuna.storages.RDBStorage(f"sqlite:///{path}"), path
    from optuna.storages.journal import JournalFileBackend
    return optuna.storages.JournalStorage(JournalFileBackend(str(path))), path


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold `PATH.lock-tune` for the study's run; a second process is refused, one line."""
    lock = path.with_name(path.name + ".lock-tune")
    with open(lock, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise StudyError(f"--storage {path}: another `trainplan tune` runs this study "
                             f"(lock {lock}); wait for it or stop it") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def load_study(storage, name: str, suite: dict | None, create: bool):
    import optuna

    with warnings.catch_warnings():  # `group` is marked experimental; it is what we need
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(
            multivariate=True, group=True, n_startup_trials=(suite or SUITE_DEFAULTS)["n_startup"],
            seed=(suite or SUITE_DEFAULTS)["seed"])
    pruner = optuna.pruners.SuccessiveHalvingPruner(
        min_resource=1, reduction_factor=(suite or SUITE_DEFAULTS)["reduction_factor"])
    if not create:
        names = [s.study_name for s in storage.get_all_studies()]
        if name not in names:
            raise StudyError(f"--study-name {name!r} is not in the storage; studies: {names}")
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                sampler=sampler, pruner=pruner, load_if_exists=True)
    if suite is not None:
        stored = study.user_attrs.get("suite")
        if stored is None:
            study.set_user_attr("suite", suite)
        elif {k: stored.get(k) for k in ("model", "gpus", "seq_len", "layout")} != \
                {k: suite[k] for k in ("model", "gpus", "seq_len", "layout")}:
            raise StudyError(f"study {name!r} was made for {stored['model']} on "
                             f"{stored['gpus']} GPUs, seq {stored['seq_len']}; use another "
                             "--study-name for this suite")
    return study


# ---------------------------------------------------------------- accounting


def gpu_seconds(study) -> float:
    """Device time spent by every trial of the study (all states), from storage."""
    trials = study.get_trials(deepcopy=False)
    return sum(float(t.user_attrs.get("gpu_seconds", 0.0)) for t in trials)


def measured(study) -> list:
    """Trials that ran the harness and finished with a figure (duplicates not counted)."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("measured")]


def recover(study) -> int:
    """Mark RUNNING trials left by a killed study FAIL ("interrupted"); their spend stays."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in stale:
        study._storage.set_trial_user_attr(t._trial_id, "interrupted", "study process died")
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    return len(stale)


# ---------------------------------------------------------------- the study


def _duplicate(study, cfg: dict, number: int):
    for t in measured(study):
        if t.user_attrs.get("config") == cfg and t.number != number:
            return t
    return None


def _log(path: Path, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields})
                + "\n")


def run_study(suite: dict, *, storage: str, name: str, gpu_hours: float, trials: int,
              cpu: bool = False, records_path: str | None = None,
              stop_after_s: float | None = None, progress: bool = True) -> dict:
    """Run (or resume) the study until `trials` configs are measured or a limit stops it."""
    from optuna.trial import TrialState
    from tqdm import tqdm

    from trainplan import tune_launch as tl

    card = tl.card_name(cpu)  # before the storage: a bad request writes nothing
    gpu = tl.gpu_for(card, suite)
    store, path = open_storage(storage, must_exist=False)
    budget_s = gpu_hours * 3600.0
    start = time.monotonic()
    log = path.with_name(path.stem + ".log")
    with exclusive(path):
        study = load_study(store, name, suite, create=True)
        recovered = recover(study)
        sp = knobs.space(suite["space"])
        rec_path = Path(records_path) if records_path else path.with_name(
            path.stem + "-measurements.jsonl")
        study.set_user_attr("budget_gpu_hours", gpu_hours)
        study.set_user_attr("card", card)
        first = len(measured(study))
        bar = tqdm(total=trials, initial=min(first, trials), desc=f"tune {name}",
                   file=sys.stderr, disable=not progress, unit="config")
        stopped, proposals = None, 0
        dp = suite["layout"].get("dp", 1)
        while stopped is None:
            spent = gpu_seconds(study)
            costs = [c for t in study.get_trials(deepcopy=False)
                     for c in t.user_attrs.get("launch_gpu_seconds", [])]
            expected = statistics.median(costs) if costs else 0.0
            wall = expected / suite["gpus"]
            if len(measured(study)) >= trials:
                stopped = "trials"
            elif spent >= budget_s or spent + expected > budget_s:
                stopped = "budget"
            elif stop_after_s and time.monotonic() - start + wall > stop_after_s:
                stopped = "time"
            elif proposals >= 20 * trials:
                stopped = "space"
            if stopped:
                break
            proposals += 1
            trial = study.ask()
            cfg = knobs.suggest(trial, sp, world=suite["gpus"], dp=dp)
            trial.set_user_attr("config", cfg)
            reason = knobs.skip_reason(cfg, suite, gpu)
            if reason:
                trial.set_user_attr("skipped", reason)
                trial.set_constraint("runnable", 1.0)  # infeasible: TPE learns to avoid it
                study.tell(trial, state=TrialState.PRUNED)
                _log(log, trial=trial.number, skipped=reason)
                continue
            dup = _duplicate(study, cfg, trial.number)
            if dup is not None:
                trial.set_user_attr("duplicate_of", dup.number)
                study.tell(trial, dup.value)
                continue
            outcome = _measure(study, trial, suite, cfg, tl, cpu=cpu, budget_s=budget_s,
                               spent=spent, start=start, stop_after_s=stop_after_s,
                               rec_path=rec_path, log=log, name=name)
            if outcome in ("budget", "time"):
                stopped = outcome
            bar.n = min(len(measured(study)), trials)
            best = max((t.value for t in measured(study)), default=None)
            bar.set_postfix(best=f"{best:,.0f}" if best else "-",
                            gpu_h=f"{gpu_seconds(study) / 3600:.3f}/{gpu_hours:g}")
            bar.refresh()
        bar.close()
        done = measured(study)
        spent_h = gpu_seconds(study) / 3600.0
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
            "best": None if best is None else {
                "trial": best.number, "config": best.user_attrs["config"],
                "tokens_per_s_per_gpu": best.value, "ci": best.user_attrs["ci"]}}


def _measure(study, trial, suite, cfg, tl, *, cpu, budget_s, spent, start, stop_after_s,
             rec_path, log, name) -> str:
    """Launch the config (successive halving decides on a second launch); tell the study."""
    from optuna.trial import TrialState

    gpus = suite["gpus"]
    summaries, launch_costs, used, result = [], [], 0.0, "ok"
    env = tl.launch_env(cfg)
    cmd = tl.launch_command(suite, cfg, cpu)

    for launch in range(suite["max_launches"]):
        if launch:  # a replicate only where budget and time allow: else keep the figure so far
            nxt = statistics.median(launch_costs)
            late = stop_after_s and time.monotonic() - start + nxt / gpus > stop_after_s
            if spent + used + nxt > budget_s or late:
                break

        def tick(elapsed, used=used):
            cost = used + elapsed * gpus
            trial.set_user_attr("gpu_seconds", cost)
            if spent + cost > budget_s:
                return "budget"
            if stop_after_s and time.monotonic() - start > stop_after_s:
                return "time"
            return None

        run_cmd = cmd if cpu else [*cmd, "--records", str(rec_path),
                                     "--run-id", f"{name}/trial-{trial.number}/launch-{launch}"]
        summary, error, seconds = tl.run_launch(run_cmd, env, tick=tick,
                                                deadline_s=suite["launch_timeout_s"])
        used += seconds * gpus
        launch_costs.append(seconds * gpus)
        trial.set_user_attr("gpu_seconds", used)
        trial.set_user_attr("launch_gpu_seconds", launch_costs)
        _log(log, trial=trial.number, launch=launch, seconds=round(seconds, 2), config=cfg,
             rate=summary and summary["tokens_per_s_per_gpu"], error=error or None)
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
