"""The knob study: Optuna over `trainplan.tune.knobs` under a GPU-hour budget, each trial a
real harness launch. This module holds the suite, the storage, the sampler and pruner
(`load_study`) and the accounting; `trainplan.tune.loop` runs the study.

    trainplan tune --suite data/suites/tune-2gpu.yaml --storage PATH.journal \\
        --gpu-hours 0.5 --trials 48 [--stop-after-s 540] [--cpu]

`--trials` (measured configurations) and `--gpu-hours` are the study's totals, counted from
storage, so rerunning the same command resumes it. Budget: every launch's whole wall time x
its GPUs (ranks on the CPU proxy), start-up, warm-up and compile included, written to the
trial every `tune.trial.HEARTBEAT_S` seconds (what a killed study can lose; `recover`). A
launch is not started when the median launch so far would overrun the budget, and is killed
if it does overrun; the study then stops and says so. One process per storage (`exclusive`).

Objective: tokens/s/GPU, total tokens over total time of the kept steps (windows) of all
launches, warm-up dropped, with a bootstrap 95% interval over windows
(`trainplan.records.stats.rate_ci`), stored as user attrs. GPU launches also append a
measurement record (`--records`, written by the harness, so its provenance carries the
launch's own NCCL environment) with run_id `STUDY/trial-N/launch-K`; that trial's user attrs
hold the full knob config. The GPU study's device call: `lib/trainplan/bench/README.md`,
"Running on the lent GPU machines".
"""

from __future__ import annotations

import contextlib
import fcntl
import warnings
from pathlib import Path

from trainplan.errors import SpecError, TrainplanError
from trainplan.loader import MAX_LOG_BYTES, is_file_of, json_lines, load_yaml, quote, shown
from trainplan.specs import load_cluster, load_model
from trainplan.specs.bounds import MAX_GPUS, MAX_SEQ_LEN
from trainplan.tune import knobs

SUITE_DEFAULTS = {"cluster": "dgx-h100", "gpu": "h100-sxm", "seq_len": 2048, "warmup": 3,
                  "windows": 10, "target_sequences": 160, "max_measure_s": 25.0,
                  "max_launches": 2, "reduction_factor": 4, "n_startup": 10, "seed": 0,
                  "launch_timeout_s": 300.0, "extra_args": [], "space": {}, "data": "stdlib"}
DATA = ("stdlib", "instruct")  # the harness's --data: packed text, or instruction records
# A suite's numbers: field -> (lowest, highest, whole number?); beyond these a value is a typo
SUITE_NUMBERS = {"gpus": (1, MAX_GPUS, True), "seq_len": (1, MAX_SEQ_LEN, True),
                 "warmup": (0, 10**6, True), "windows": (1, 10**6, True),
                 "target_sequences": (1, 10**9, True), "max_launches": (1, 1000, True),
                 "reduction_factor": (2, 1000, True), "n_startup": (0, 10**6, True),
                 "seed": (0, 2**32 - 1, True), "max_measure_s": (1e-3, 1e6, False),
                 "launch_timeout_s": (1.0, 1e6, False)}
SUITE_FIELDS = sorted({*SUITE_DEFAULTS, "model", "gpus", "layout"})


class StudyError(TrainplanError):
    """A study that cannot be run or read (storage, suite, another process holding it)."""


def import_optuna():
    """optuna, imported without tqdm's "IProgress not found" warning: optuna imports
    tqdm.auto, which in a notebook kernel without ipywidgets warns on stderr (the recipe
    page must build clean); the study's own progress bar writes to a terminal."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import optuna
    return optuna


# ---------------------------------------------------------------- suite and storage


def make_suite(*, suite_path: str | None = None, model: str | None = None, gpus: int = 1,
               seq_len: int | None = None) -> dict:
    """A tune suite from a YAML file, or from --model/--gpus (data parallel over all GPUs)."""
    if suite_path:
        raw = load_yaml(suite_path, what="tune suite (YAML)")
        if not isinstance(raw, dict) or "model" not in raw or "gpus" not in raw:
            raise SpecError(f"--suite {shown(suite_path)}: expected a mapping with 'model' and "
                            "'gpus'")
    else:
        raw = {"model": model, "gpus": gpus}
    suite = {**SUITE_DEFAULTS, **raw}
    if seq_len:
        suite["seq_len"] = seq_len
    suite.setdefault("layout", {"dp": suite["gpus"]})
    check_suite(suite, f"--suite {shown(suite_path)}" if suite_path else "tune")
    unknown = set(suite["layout"]) - {"dp", "tp", "pp"}
    if unknown or suite["layout"].get("dp", 1) * suite["layout"].get("tp", 1) * \
            suite["layout"].get("pp", 1) != suite["gpus"]:
        raise SpecError(f"suite layout {suite['layout']} must give dp x tp x pp = gpus "
                        f"{suite['gpus']} (keys dp, tp, pp)")
    if suite["data"] not in DATA:
        raise SpecError(f"suite data {suite['data']!r} is not valid; use one of {list(DATA)}")
    load_model(suite["model"]), load_cluster(suite["cluster"])  # a bad preset fails here
    knobs.space(suite["space"])
    return suite


def check_suite(suite: dict, where: str) -> None:
    """Raise SpecError, naming `where` and the field, unless every field of `suite` is known
    and of its type, and each number in its `SUITE_NUMBERS` range."""
    unknown = sorted(set(suite) - set(SUITE_FIELDS), key=str)
    if unknown:
        raise SpecError(f"{where}: unknown field {quote(unknown[0])}; fields: {SUITE_FIELDS}")
    for field, (low, high, whole) in SUITE_NUMBERS.items():
        value = suite[field]
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
                or not low <= value <= high:  # NaN fails the range too
            shown_range = f"{low:,} to {high:,}" if whole else f"{low:g} to {high:g}"
            raise SpecError(f"{where}: {field} = {quote(value)} is not valid; use a "
                            f"{'whole ' if whole else ''}number {shown_range}")
    for field, kind, what in (("model", str, "a preset or YAML file"), ("cluster", str, "a "
                              "preset or YAML file"), ("gpu", str, "a preset or YAML file"),
                              ("layout", dict, "a mapping of dp, tp, pp"),
                              ("space", dict, "a mapping of knob -> choices"),
                              ("extra_args", list, "a list of the harness's arguments")):
        if not isinstance(suite[field], kind):
            raise SpecError(f"{where}: {field} = {quote(suite[field])} is not valid; use {what}")
    if not all(type(a) in (str, int, float) for a in suite["extra_args"]) or not all(
            type(v) is int and v >= 1 for v in suite["layout"].values()):
        raise SpecError(f"{where}: extra_args = {quote(suite['extra_args'])}, layout = "
                        f"{quote(suite['layout'])}; use strings and numbers, and whole degrees "
                        ">= 1")


def storage_path(spec: str, *, flag: str = "--storage") -> tuple[str, Path]:
    """('journal' | 'sqlite', file path) of a --storage value: `sqlite:///PATH` or a path
    ending in .db, .sqlite or .sqlite3 is SQLite; `journal:PATH` or any other path a journal
    file. A value naming no file ('', 'journal:', 'sqlite:///', '.', '..') is one StudyError
    naming `flag`."""
    if spec.startswith("sqlite:///"):
        kind, path = "sqlite", Path(spec[len("sqlite:///"):])
    else:
        path = Path(spec[len("journal:"):] if spec.startswith("journal:") else spec)
        kind = "sqlite" if path.suffix in (".db", ".sqlite", ".sqlite3") else "journal"
    if path.name in ("", ".."):
        raise StudyError(f"{flag} {quote(spec)} names no file; use a study file: PATH or "
                         "journal:PATH (an Optuna journal) or sqlite:///PATH")
    return kind, path


SQLITE = b"SQLite format 3\x00"  # the first bytes of every SQLite database file
# What each journal operation needs (optuna.storages.journal's op codes 0-10), checked before
# Optuna replays the file: a line without them would fail inside Optuna with a KeyError.
JOURNAL_KEYS = {0: ("study_name", "directions"), 1: ("study_id",), 2: ("study_id", "user_attr"),
                3: ("study_id", "system_attr"), 4: ("study_id", "datetime_start"),
                5: ("trial_id", "param_name", "param_value_internal", "distribution"),
                6: ("trial_id", "state"), 7: ("trial_id", "step", "intermediate_value"),
                8: ("trial_id", "user_attr"), 9: ("trial_id", "system_attr"), 10: ()}


def check_journal(spec: str, path: Path, *, flag: str = "--storage") -> None:
    """Raise StudyError (one line, naming `flag` and `spec`) unless `path` is an Optuna
    journal: UTF-8, one JSON object a line, each a known operation with the fields it needs.
    A last line cut short by a kill (no newline) is left for Optuna, which skips it."""
    if not path.exists():
        return
    try:
        ops = json_lines(path, error=StudyError, what="study journal", constants=True,
                         max_bytes=MAX_LOG_BYTES)
    except StudyError as err:  # names the file and line: PATH:N: what is wrong
        raise StudyError(f"{flag} {err}") from None
    for number, op in ops:
        need = JOURNAL_KEYS.get(op.get("op_code")) if isinstance(op, dict) else None
        if need is None or "worker_id" not in op or any(k not in op for k in need):
            raise StudyError(f"{flag} {shown(spec)}: line {number} is not an Optuna journal "
                             f"operation ({quote(op, 60)}); give a study's journal file")


def open_storage(spec: str, *, must_exist: bool, flag: str = "--storage"):
    """(Optuna storage, file path) of a storage value, checked (`check_journal`, the SQLite
    signature) and replayed once here, so that a malformed file is one StudyError line naming
    the command's `flag`; the journal needs no SQLAlchemy."""
    kind, path = storage_path(spec, flag=flag)
    if must_exist and path.is_dir():
        raise StudyError(f"{flag} {shown(spec)} is a folder; name the study file in it: PATH "
                         "or journal:PATH (an Optuna journal) or sqlite:///PATH")
    if must_exist and not path.is_file():
        raise StudyError(f"{flag} {shown(spec)}: no study there (no file {shown(path)})")
    if not path.parent.is_dir():
        raise StudyError(f"{flag} {shown(spec)}: folder {shown(path.parent)} does not exist")
    if path.exists() and (not path.is_file() or (kind == "sqlite" and path.stat().st_size
                                                  and not is_file_of(path, SQLITE))):
        raise StudyError(f"{flag} {shown(spec)}: not a {kind} study file")
    if kind == "journal":
        check_journal(spec, path, flag=flag)
    optuna = import_optuna()

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    errors = (KeyError, ValueError, TypeError, AssertionError, IndexError, AttributeError,
              optuna.exceptions.OptunaError)
    if kind == "sqlite":
        from sqlalchemy.exc import SQLAlchemyError
        errors += (SQLAlchemyError,)
    try:
        if kind == "sqlite":
            store = optuna.storages.RDBStorage(f"sqlite:///{path}")
        else:
            from optuna.storages.journal import JournalFileBackend
            store = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        store.get_all_studies()  # replays a journal: its errors surface here, as one line
    except errors as err:
        err = getattr(err, "orig", None) or err  # SQLAlchemy's wraps the driver's
        raise StudyError(f"{flag} {shown(spec)}: Optuna cannot read it "
                         f"({type(err).__name__}: {quote(str(err), 60)})") from None
    return store, path


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
    """The study `name`: created with `load_if_exists` (a rerun resumes it) or only read; a
    suite must match the one it was made for.

    Sampler: `TPESampler(multivariate=True, group=True)`, the first `n_startup` trials random
    (a space-filling start). The space is small, mostly categorical, conditional (prefetch
    only with workers) and noisy. TPE models categorical and integer knobs natively (Bergstra
    et al. 2011, NeurIPS, "Algorithms for Hyper-Parameter Optimization"); multivariate TPE
    models their interactions (micro-batch x recompute x ZeRO share one memory budget; Falkner
    et al. 2018, BOHB); `group=True` gives the conditional prefetch knob its own subspace; TPE
    splits trials by rank quantile, not value, so noise of a few percent moves it little
    (Watanabe 2023, arXiv:2304.11127). GP and CMA-ES samplers handle categorical knobs
    poorly. Skipped and crashed configs count as infeasible (`Trial.set_constraint` > 0,
    `trainplan.tune.loop`), so TPE learns to avoid them without a made-up objective value.

    Pruner: successive halving over launches (Jamieson and Talwalkar 2016; Li et al. 2017,
    Hyperband). Every config gets one launch; those in the top 1/`reduction_factor` at that
    rung get a second, fresh launch, which replicates the best configs (launch-to-launch
    noise) instead of spending the budget on plainly slower ones. A config not promoted keeps
    its one-launch figure and ends COMPLETE: nothing measured is thrown away.
    """
    optuna = import_optuna()

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
            raise StudyError(f"--study-name {quote(name)} is not in the storage; studies: {names}")
    if create:
        study = optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                    sampler=sampler, pruner=pruner, load_if_exists=True)
    else:  # reading a study (the report, a committed journal) must not write to it
        study = optuna.load_study(storage=storage, study_name=name, sampler=sampler,
                                  pruner=pruner)
    if suite is not None:
        stored = study.user_attrs.get("suite")
        if stored is None:
            study.set_user_attr("suite", suite)
        elif {k: stored.get(k) for k in ("model", "gpus", "seq_len", "layout")} != \
                {k: suite[k] for k in ("model", "gpus", "seq_len", "layout")} or \
                stored.get("data", "stdlib") != suite.get("data", "stdlib"):
            raise StudyError(f"study {quote(name)} was made for {stored['model']} on "
                             f"{stored['gpus']} GPUs, seq {stored['seq_len']}, data "
                             f"{stored.get('data', 'stdlib')}; use another --study-name for "
                             "this suite")
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
