"""What a knob study found: importance, per-knob effects with intervals, the top knobs, the best.

    trainplan tune --report --storage PATH [--study-name NAME] --json
      -> {"trials", "gpu_hours", "top_knobs": [...], "best": {...}, ...}

Only measured trials count (not skipped, crashed, interrupted or duplicate
proposals). Two analyses, because each answers a different question:

- Importance: PED-ANOVA (Watanabe et al. 2023, IJCAI, "PED-ANOVA:
  Efficiently Quantifying Hyperparameter Importance in Arbitrary Subspaces";
  conditional knobs as in its KDD 2026 extension), through
  `optuna.importance.PedAnovaImportanceEvaluator`: how much each knob's
  distribution differs between the top trials and all trials. It needs no
  scikit-learn (fANOVA does), and is computed from `MIN_IMPORTANCE` trials on.
- Effects: log(tokens/s/GPU) = b0 + sum of one-hot knob levels (main effects,
  each knob against its default's level), least squares with a tiny ridge, a
  percentile bootstrap over trials (Efron and Tibshirani 1993, ch. 13) for
  95% intervals. TPE does not sample a balanced design, so raw per-level
  means would mix in the other knobs; the joint fit separates them as far
  as additivity holds. Effects are percent changes, exp(b) - 1.

A knob has "no measurable effect" when every level's interval contains 0
(docs/measurement.md: compare settings only where intervals do not overlap). The top
knobs are ranked by the largest effect whose interval excludes 0, then by
importance: PED-ANOVA asks what distinguishes the top few trials, and with a
few dozen noisy trials it can rank a knob with no effect first (seen on a
simulated study in tests/tune/test_tune.py), so it is reported beside the
effects, not instead of them. Integer knobs are grouped into the levels of
`knobs.BINS`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from trainplan.loader import quote, shown
from trainplan.tune import effect_stats, knobs
from trainplan.tune.study import (
    StudyError,
    gpu_seconds,
    import_optuna,
    load_study,
    measured,
    open_storage,
    storage_path,
)

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "data" / "measurements" / "tune-proxy-h200x4-20261128" / "study.journal"
# effects-only studies (storage, study name) whose layout families join the committed
# study's (`committed`); the TP storage also holds an earlier study whose NCCL pairs are void
EFFECTS_STUDIES = (
    (ROOT / "data" / "measurements" / "tune-exposed-h200x4-20261128" / "study.journal",
     "tune-exposed-4gpu"),
    (ROOT / "data" / "measurements" / "tune-effects-h200x2-20261128" / "fsdp.journal", "suite"),
    (ROOT / "data" / "measurements" / "tune-effects-h200x2-20261128b" / "tp.journal",
     "tp-suite"))
MIN_IMPORTANCE = 10
N_BOOT = 2000
RIDGE = 1e-3
MAX_RATE = 1e9  # tokens/s/GPU a trial can report: far above any card


def load(storage: str, name: str | None = None, *, flag: str = "--storage"):
    """The study (the only one in the storage unless `name` says which); errors name `flag`,
    the option that gave `storage` (`tune --storage`, `suggest --study`)."""
    store, path = open_storage(storage, must_exist=True, flag=flag)
    names = [s.study_name for s in store.get_all_studies()]
    if not names:
        raise StudyError(f"{flag} {shown(storage)}: holds no study")
    if name is None and len(names) > 1:
        fix = ("pick one with --study-name" if flag == "--storage" else
               f"{flag} reads a storage holding one study")
        raise StudyError(f"{flag} {shown(storage)} holds {len(names)} studies {names}; {fix}")
    return load_study(store, name or names[0], None, create=False)


def frame(trials) -> pd.DataFrame:
    """One row per measured trial: figure (tokens/s/GPU, 0 to MAX_RATE, else ValueError),
    interval, knob values and analysis levels."""
    rows = []
    for t in trials:
        if not 0 < t.value <= MAX_RATE:  # a hand-edited journal: NaN, negative, 1e300
            raise ValueError(f"trial {t.number}'s value {t.value:.3g} is not 0 to {MAX_RATE:.0e}")
        cfg = t.user_attrs["config"]
        row = {"trial": t.number, "tokens_per_s_per_gpu": t.value, "ci_low": t.user_attrs["ci"][0],
               "ci_high": t.user_attrs["ci"][1], "launches": t.user_attrs.get("launches", 1)}
        row.update({f"{k}": v for k, v in cfg.items()})
        row.update({f"level:{k}": knobs.level(k, v) for k, v in cfg.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def importance(trials, direction, caveats: list | None = None) -> dict[str, float] | None:
    """PED-ANOVA importance of each sampled knob, or None with fewer than MIN_IMPORTANCE trials.

    Optuna's warnings (e.g. a knob level seen in fewer than 2 trials) go into `caveats`,
    which the report prints, rather than onto stderr."""
    if len(trials) < MIN_IMPORTANCE:
        return None
    import warnings

    optuna = import_optuna()
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    study = optuna.create_study(direction=direction)
    study.add_trials(trials)
    quantile = min(0.5, max(0.1, 5 / len(trials)))  # >= 5 trials above it (optuna's advice)
    evaluator = PedAnovaImportanceEvaluator(target_quantile=quantile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = get_param_importances(study, evaluator=evaluator)
    if caveats is not None:
        caveats += sorted({str(w.message) for w in caught})
    return {k: float(v) for k, v in values.items()}


def _reference(df: pd.DataFrame, knob: str) -> str:
    levels = df[f"level:{knob}"]
    default = knobs.level(knob, knobs.SPACE[knob].default)
    return default if (levels == default).any() else levels.value_counts().index[0]


def _design(df: pd.DataFrame, varied: list[str], refs: dict) -> tuple[np.ndarray, list]:
    cols, names = [np.ones(len(df))], []
    for k in varied:
        for lev in sorted(set(df[f"level:{k}"]) - {refs[k]}):
            cols.append((df[f"level:{k}"] == lev).to_numpy(float))
            names.append((k, lev))
    return np.column_stack(cols), names


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    penalty = RIDGE * np.eye(x.shape[1])
    penalty[0, 0] = 0.0  # the intercept is not shrunk
    return np.linalg.solve(x.T @ x + penalty, x.T @ y)


def effects(df: pd.DataFrame, seed: int = 0) -> pd.DataFrame | None:
    """Per-knob level effects (% vs the reference level) with bootstrap 95% intervals.

    None when there are too few trials for the number of levels (n < levels + 3).
    """
    names = [k for k in knobs.SPACE if f"level:{k}" in df]
    varied = [k for k in names if df[f"level:{k}"].nunique() > 1]
    refs = {k: _reference(df, k) for k in varied}
    x, cols = _design(df, varied, refs)
    if not cols or len(df) < x.shape[1] + 3:
        return None
    y = np.log(df["tokens_per_s_per_gpu"].to_numpy(float))
    beta = _fit(x, y)
    rng = np.random.default_rng(seed)
    boot = np.empty((N_BOOT, len(beta)))
    for i in range(N_BOOT):
        idx = rng.integers(0, len(df), len(df))
        boot[i] = _fit(x[idx], y[idx])
    low, high = np.percentile(boot, [2.5, 97.5], axis=0)
    rows = []
    for j, (k, lev) in enumerate(cols, start=1):
        pct = lambda b: 100.0 * (np.exp(b) - 1.0)  # noqa: E731
        rows.append({"knob": k, "level": lev, "vs": refs[k],
                     "n": int((df[f"level:{k}"] == lev).sum()), "effect_pct": pct(beta[j]),
                     "low_pct": pct(min(low[j], beta[j])), "high_pct": pct(max(high[j], beta[j]))})
    return pd.DataFrame(rows)


def _counts(study) -> dict:
    trials = study.get_trials(deepcopy=False)
    reasons: dict[str, int] = {}
    for t in trials:
        if "skipped" in t.user_attrs:
            key = t.user_attrs["skipped"].split(":")[0].split(" ")[0]
            reasons[key] = reasons.get(key, 0) + 1
    return {"skipped": sum("skipped" in t.user_attrs for t in trials),
            "skipped_by": reasons,
            "failed": sum("failed" in t.user_attrs for t in trials),
            "interrupted": sum("interrupted" in t.user_attrs for t in trials),
            "duplicates": sum("duplicate_of" in t.user_attrs for t in trials)}


def analyse(study) -> dict:
    """The report of one loaded study (see the module docstring)."""
    trials = measured(study)
    df = frame(trials)
    caveats: list[str] = []
    imp = importance(trials, study.direction, caveats)
    eff = effects(df) if len(df) else None
    size = {}  # knob -> largest |effect| of a level whose interval excludes 0 (0 if none)
    if eff is not None:
        for r in eff.itertuples():
            clear = r.low_pct > 0 or r.high_pct < 0
            size[r.knob] = max(size.get(r.knob, 0.0), abs(r.effect_pct) if clear else 0.0)
    names = list(dict.fromkeys([*size, *(imp or {})]))
    ranked = sorted(names, key=lambda k: (-size.get(k, 0.0), -(imp or {}).get(k, 0.0)))
    knob_rows = []
    for k in ranked:
        rows = eff[eff["knob"] == k] if eff is not None else pd.DataFrame()
        measurable = bool(((rows["low_pct"] > 0) | (rows["high_pct"] < 0)).any()) \
            if len(rows) else None
        knob_rows.append({
            "knob": k, "importance": imp.get(k) if imp else None,
            "verdict": {True: "measurable effect", False: "no measurable effect",
                        None: "not estimated"}[measurable],
            "effects": [{"level": r.level, "vs": r.vs, "n": r.n,
                         "effect_pct": round(r.effect_pct, 2),
                         "ci_pct": [round(r.low_pct, 2), round(r.high_pct, 2)]}
                        for r in rows.itertuples()]})
    best = max(trials, key=lambda t: t.value, default=None)
    suite = study.user_attrs.get("suite", {})
    return {
        "study": study.study_name, "model": suite.get("model"), "gpus": suite.get("gpus"),
        "card": study.user_attrs.get("card"), "trials": len(trials),
        "gpu_hours": gpu_seconds(study) / 3600.0,
        "budget_gpu_hours": study.user_attrs.get("budget_gpu_hours"),
        "workers": study.user_attrs.get("workers", 1),
        "top_knobs": knob_rows[:3], "knobs": knob_rows,
        "no_measurable_effect": [r["knob"] for r in knob_rows
                                 if r["verdict"] == "no measurable effect"],
        "importance_method": "PED-ANOVA" if imp else f"none (fewer than {MIN_IMPORTANCE} trials)",
        "importance_caveats": caveats,
        "best": None if best is None else {
            "trial": best.number, "config": best.user_attrs["config"],
            "tokens_per_s_per_gpu": best.value, "ci": best.user_attrs["ci"],
            "launches": best.user_attrs.get("launches", 1)},
        **_counts(study),
    }


def report(storage: str, name: str | None = None, *, flag: str = "--storage") -> dict:
    """The analysis of the study in `storage`; one StudyError line (naming `flag`) for a study
    whose trials lack what `trainplan tune` writes (config, interval, figure) or hold the
    wrong types."""
    study = load(storage, name, flag=flag)
    try:
        return {**analyse(study), "effects": study_effects(study, storage)}
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise StudyError(f"{flag} {shown(storage)}: its trials are not a `trainplan tune` "
                         f"study's ({type(err).__name__}: {quote(str(err), 60)})") from None


def study_effects(study, storage: str) -> dict | None:
    """The effects stage's summary of `study` (`effect_stats.summary`), each design marked
    with where it ran: the study's model, GPUs and card."""
    records = effect_stats.read_records(effect_stats.paths(storage_path(storage)[1])[0])
    suite = study.user_attrs.get("suite") or {}
    return effect_stats.summary(records, study.study_name, where={
        "model": suite.get("model"), "gpus": suite.get("gpus"),
        "card": study.user_attrs.get("card")})


def committed(path: Path = COMMITTED, effects_from=EFFECTS_STUDIES) -> dict | None:
    """The committed GPU study's report, its effects joined with those of the committed
    effects-only studies (a family from the one with the most pairs there); None when no
    study has been committed yet."""
    if not Path(path).is_file():
        return None
    out = report(str(path))
    more = [study_effects(load(str(p), name), str(p)) for p, name in effects_from]
    return {**out, "effects": effect_stats.join([out["effects"], *more])}


def format_report(out: dict) -> str:
    lines = [f"study {out['study']}: {out['model']} on {out['gpus']} x {out['card']}, "
             f"{out['trials']} configurations measured, {out['gpu_hours']:.3f} GPU-hours "
             f"(skipped {out['skipped']}, failed {out['failed']}, "
             f"interrupted {out['interrupted']})"]
    if out.get("workers", 1) > 1:
        lines.append(f"  {out['workers']} launches at a time, each on its own "
                     f"{out['gpus']} GPUs of one host")
    lines += [f"  caveat: {c}" for c in out.get("importance_caveats", [])]
    for r in out["top_knobs"]:
        imp = f"importance {r['importance']:.2f}, " if r["importance"] is not None else ""
        lines.append(f"  {r['knob']}: {imp}{r['verdict']}")
        for e in r["effects"]:
            lines.append(f"    {e['level']} vs {e['vs']}: {e['effect_pct']:+.1f}% "
                         f"(95% CI {e['ci_pct'][0]:+.1f} to {e['ci_pct'][1]:+.1f}%, n={e['n']})")
    if out["best"]:
        b = out["best"]
        lines.append(f"  best: trial {b['trial']}, {b['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
                     f"(95% CI {b['ci'][0]:,.0f}-{b['ci'][1]:,.0f}): {b['config']}")
    return "\n".join(lines + effect_stats.format_lines(out.get("effects")))
