"""`trainplan suggest`: a starting config from model size, GPU count and dataset size, with reasons.

    trainplan suggest --model-size 7B --gpus 16 --dataset-tokens 1T [--gpu h100-sxm] --json

--dataset-tokens (2e9, 500M, 1T; `parse_tokens`) sets the estimate's steps and GPU-hours.

1. Model: a preset whose parameter count is within `PRESET_TOLERANCE` of the
   size (llama-1.3b, -7b, -13b, -70b; "8x7B" is mixtral-8x7b); otherwise a
   Llama-style spec built from standard shapes: the width and head count of
   the nearest row of `SHAPES` (GPT-3, Brown et al. 2020, Table 2.1; Llama,
   Touvron et al. 2023), 128-wide heads, SwiGLU width 8h/3 rounded up to a
   multiple of 256 (Llama's rule), vocabulary 32000, and as many layers as
   reach the size.
2. Global batch: the nearest row's batch (GPT-3 Table 2.1: 0.5M tokens up
   to 760M, 1M to 2.7B, 2M to 13B; 4M above, as Llama 2), rounded up to a
   whole number of sequences per GPU; `--global-batch-tokens` overrides.
3. Layout, micro-batch, accumulation and throughput: the planner's best
   fitting layout (`trainplan.plan.search`), the same code path as `trainplan plan`.
4. NCCL and data loader: the committed knob study's findings where it has
   them (`trainplan.tune.report`), else the defaults, said as such ("defaults:
   no study yet"); no effect is claimed that was not measured. Each knob's paired
   effect on the plan's layout family is cited where measured, with "set", "leave
   default" or "not measured" (`trainplan.tune.effect_stats`), and decides its value.
5. Time to train: one pass over the dataset at the planner's steady-state
   rate (`perf.time_to_train`); failures, restarts and checkpoint stalls come
   on top (runbook page 5).

Refused, one line and exit 2: a size that does not parse or is out of range,
a model that fits no layout on that many GPUs, a GPU count that is not whole
nodes, a dataset smaller than one global batch or outside one sequence to
`MAX_TOKENS` tokens.
"""

from __future__ import annotations

import math
import re

from trainplan.cost import params
from trainplan.errors import LayoutError, SpecError, TrainplanError
from trainplan.loader import quote
from trainplan.specs import ModelSpec, load_cluster, load_model
from trainplan.specs.layouts import strategy_family
from trainplan.tune.effect_stats import family_advice
from trainplan.tune.effect_stats import where as ran_on
from trainplan.tune.knobs import NCCL_ALGO_ENV, NCCL_PROTO_ENV

PRESETS = ("llama-1.3b", "llama-7b", "llama-13b", "llama-70b")
PRESET_TOLERANCE = 0.15  # a size within 15% of a preset's count means that preset
MIN_PARAMS, MAX_PARAMS = 1e8, 2e12
MAX_TOKENS = 1e16  # --dataset-tokens: ~700x the largest published runs (Llama 3: 15T)
VOCAB = 32000
# (parameters, layers, hidden, heads, global batch tokens): GPT-3 Table 2.1 and Llama 1/2
SHAPES = ((125e6, 12, 768, 12, 2**19), (350e6, 24, 1024, 16, 2**19),
          (760e6, 24, 1536, 16, 2**19), (1.3e9, 24, 2048, 16, 2**20),
          (2.7e9, 32, 2560, 20, 2**20), (6.7e9, 32, 4096, 32, 2**21),
          (13e9, 40, 5120, 40, 2**21), (33e9, 60, 6656, 52, 2**22),
          (70e9, 80, 8192, 64, 2**22), (175e9, 96, 12288, 96, 2**22))
UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
LOADER_DEFAULTS = {"num_workers": 2, "prefetch_factor": 2, "pin_memory": True}


class SuggestError(TrainplanError):
    """A suggest request that cannot be answered (bad size, nothing fits, too little data)."""


def parse_size(text: str) -> tuple[float, str | None]:
    """'7B' -> (7e9, None); '8x7B' -> (46.7e9, 'mixtral-8x7b'); else SuggestError."""
    s = text.strip().upper().replace("_", "")
    if s == "8X7B":
        return 46.7e9, "mixtral-8x7b"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBT])", s)
    if not m:
        raise SuggestError(f"--model-size {quote(text)} is not a size; use a number and a unit, "
                           "e.g. 350M, 1.3B, 7B, 70B (or 8x7B for the Mixtral MoE)")
    n = float(m[1]) * UNITS[m[2]]
    if not MIN_PARAMS <= n <= MAX_PARAMS:
        raise SuggestError(f"--model-size {quote(text)} is out of range; use 100M to 2T parameters")
    return n, None


def parse_tokens(text: str) -> float:
    """--dataset-tokens: a count > 0 written as a number (2e9, 2_000_000) or a number and a
    unit of `UNITS` (500M, 1.5B, 1T; either case); else SuggestError."""
    s = text.strip().replace("_", "")
    unit = UNITS.get(s[-1:].upper(), 1.0) if s[-1:].isalpha() else 1.0
    try:
        value = float(s[:-1] if unit != 1.0 else s) * unit
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise SuggestError(f"--dataset-tokens {quote(text)} is not a token count; use a number "
                           "> 0, alone or with K, M, B or T (2e9, 500M, 1T)")
    return value


def _row(n: float):
    return min(SHAPES, key=lambda r: abs(math.log(r[0] / n)))


def build_model(n: float):
    """A Llama-style spec of about `n` parameters from the nearest standard shape."""
    _, _, hidden, _, _ = _row(n)
    heads = hidden // 128
    ffn = 256 * math.ceil(8 * hidden / 3 / 256)
    one = ModelSpec(name="x", n_layers=1, hidden=hidden, n_heads=heads, ffn=ffn, vocab=VOCAB)
    per_layer = params.layer_params(one)
    fixed = params.total_params(one) - per_layer
    layers = max(1, round((n - fixed) / per_layer))
    label = f"{n / 1e9:g}b" if n >= 1e9 else f"{n / 1e6:g}m"
    return ModelSpec(name=f"llama-{label}", n_layers=layers, hidden=hidden, n_heads=heads,
                     ffn=ffn, vocab=VOCAB, source="built by trainplan.tune.suggest from standard "
                     "shapes (GPT-3 Table 2.1 width and heads, Llama SwiGLU rule)")


def model_for(text: str):
    """(ModelSpec, reason) for a --model-size."""
    n, moe = parse_size(text)
    if moe:
        m = load_model(moe)
        return m, f"{text} is the {moe} preset ({params.total_params(m) / 1e9:.1f}B parameters)"
    for name in PRESETS:
        m = load_model(name)
        total = params.total_params(m)
        if abs(total / n - 1) <= PRESET_TOLERANCE:
            return m, (f"{text} matches the {name} preset ({total / 1e9:.2f}B parameters, "
                       f"{m.n_layers} layers, hidden {m.hidden})")
    m = build_model(n)
    total = params.total_params(m)
    return m, (f"no preset within {PRESET_TOLERANCE:.0%} of {text}: built a Llama-style model of "
               f"{total / 1e9:.2f}B parameters ({m.n_layers} layers, hidden {m.hidden}, "
               f"{m.n_heads} heads, FFN {m.ffn}) from standard shapes")


def global_batch(m, gpus: int, seq_len: int) -> tuple[int, str]:
    n = params.total_params(m)
    row = _row(n)
    seqs = math.ceil(row[4] / seq_len / gpus) * gpus
    return seqs * seq_len, (
        f"{row[4]:,} tokens, the batch used for {row[0] / 1e9:g}B-parameter models (GPT-3 Table "
        f"2.1; Llama 2 used 4M), rounded to {seqs} sequences of {seq_len} ({seqs // gpus} per "
        f"GPU) so every GPU gets whole sequences")


def suggest(model_size: str, *, gpus: int, dataset_tokens: float, gpu: str = "h100-sxm",
            cluster: str = "dgx-h100", seq_len: int = 4096, global_batch_tokens: int | None = None,
            study: str | None = None, spec=None, gpu_spec=None, cluster_spec=None) -> dict:
    """The starting config with a reason for each setting (see the module docstring).

    `spec`, `gpu_spec`, `cluster_spec`: loaded specs that replace `model_size`,
    `gpu` and `cluster` (the runbook page passes its scenario's).
    """
    from trainplan.calibrate.store import load_gpu  # pandas: not loaded at import

    if spec is None:
        m, model_reason = model_for(model_size)
    else:
        m, model_reason = spec, f"the scenario's model {spec.name} ({_params(spec) / 1e9:.2f}B)"
        model_size = model_size or f"{_params(spec) / 1e9:.3g}B"
    g = gpu_spec or load_gpu(gpu)
    cl = cluster_spec or load_cluster(cluster)
    if global_batch_tokens is None:
        global_batch_tokens, batch_reason = global_batch(m, gpus, seq_len)
    else:
        batch_reason = "as given (--global-batch-tokens)"
    if not seq_len <= dataset_tokens <= MAX_TOKENS:
        raise SuggestError(f"--dataset-tokens {dataset_tokens:g} is out of range; use one "
                           f"sequence (--seq-len {seq_len:,} tokens) to {MAX_TOKENS:,.0f} tokens")
    if dataset_tokens < global_batch_tokens:
        raise SuggestError(f"--dataset-tokens {dataset_tokens:g} is smaller than one global "
                           f"batch ({global_batch_tokens:,} tokens); use more data or "
                           f"--global-batch-tokens <= "
                           f"{int(dataset_tokens) // seq_len * seq_len:,} (whole sequences)")
    from trainplan.cost.step_time import time_to_train  # pandas: not loaded at import
    from trainplan.plan.planner import plan  # pandas: not loaded at import

    try:
        out = plan(m, g, cl, gpus=gpus, seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                   top=1)
    except LayoutError as err:
        raise SuggestError(f"--model-size {model_size} on --gpus {gpus}: {err}") from None
    from trainplan.compare.trust import validation  # reads the committed records once

    best = validation(out, m, g)["plans"][0]
    par = best["parallel"]
    ttt = time_to_train(dataset_tokens, best["tokens_per_s"], gpus)
    steps = math.ceil(dataset_tokens / global_batch_tokens)
    rep = study_report(study)
    knob_cfg, knob_reasons, cited = knob_settings(rep)
    family = strategy_family(par["tp"], par["pp"], par["cp"], par["ep"], par["zero"], par["dp"],
                             par["dp_shard"])
    effects, effects_reason = knob_effects(rep, family, knob_cfg)
    config = {
        "strategy": best["strategy"],
        "parallel": {k: par[k] for k in ("dp", "tp", "pp", "cp", "ep", "zero", "dp_shard",
                                         "pp_schedule", "pp_virtual", "recompute")},
        "micro_batch": par["micro_batch"], "grad_accum": par["grad_accum"],
        "global_batch_tokens": global_batch_tokens,
        "global_batch_sequences": global_batch_tokens // seq_len,
        **knob_cfg,
    }
    mem = best["memory_gib"]["total"]
    reasons = {
        "model": model_reason,
        "parallel": (f"{best['strategy']}: the fastest of {out['searched']:,} layouts that fit "
                     f"{g.name} ({mem:.1f} of {g.memory_gib:g} GiB per GPU), by the planner"),
        "micro_batch": (f"{par['micro_batch']} sequences of {seq_len}: the planner's fastest "
                        f"micro-batch that fits, recompute {par['recompute']}"),
        "global_batch": batch_reason,
        "grad_accum": (f"{par['grad_accum']} = {global_batch_tokens // seq_len} sequences / "
                       f"(dp {par['dp']} x micro-batch {par['micro_batch']})"),
        **knob_reasons,
        "knob_effects": effects_reason,
        "time_to_train": (f"{dataset_tokens:.3g} tokens at the planner's "
                          f"{best['tokens_per_s']:,.0f} tokens/s ({best['mfu']:.0%} MFU): "
                          f"{steps:,} steps; steady state only, failures, restarts and "
                          "checkpoint stalls come on top (page 5); "
                          f"{_trust_clause(best.get('validation'))}"),
    }
    if steps < 100:
        reasons["global_batch"] += (f"; only {steps} optimizer steps: consider a smaller global "
                                    "batch for a learning-rate warm-up and decay")
    return {
        "request": {"model_size": model_size, "gpus": gpus, "dataset_tokens": dataset_tokens,
                    "gpu": g.name, "cluster": cl.name, "seq_len": seq_len},
        "model": {"name": m.name, "params": _params(m), "n_layers": m.n_layers,
                  "hidden": m.hidden, "n_heads": m.n_heads, "ffn": m.ffn, "vocab": m.vocab},
        "config": config,
        "estimate": {"step_time_s": best["step_time_s"], "tokens_per_s": best["tokens_per_s"],
                     "tokens_per_s_per_gpu": best["tokens_per_s_per_gpu"], "mfu": best["mfu"],
                     "memory_gib_per_gpu": mem, "steps": steps, "hours": ttt["seconds"] / 3600,
                     "days": ttt["days"], "gpu_hours": ttt["gpu_hours"]},
        "reasons": reasons,
        "study": cited,
        "effects": {"family": family, "knobs": effects},
    }


def _trust_clause(v: dict | None) -> str:
    """What the committed records say of the plan's layout family (`plan`'s `validation`):
    its measured over predicted tokens/s band, or that it is not validated (page 4)."""
    if not v or not v.get("validated"):
        family = (v or {}).get("family") or "this layout"
        where = f" on {v['card_class']} cards" if (v or {}).get("card_class") else ""
        return f"{family} is not validated against GPU measurements{where} (page 4)"
    return (f"{v['family']} layouts measured {v['low']:.2f}-{v['high']:.2f}x these tokens/s "
            f"({v['configs']} configs on {v['card_class']} cards, page 4)")


def _params(m) -> int:
    return int(params.total_params(m))


def study_report(study: str | None) -> dict | None:
    """The report of the study `study`, else of the committed one; None when there is none."""
    from pathlib import Path

    from trainplan.tune import report as tune_report  # pandas: not loaded at import

    if study is not None:
        return tune_report.report(study, flag="--study")
    return tune_report.committed() if Path(tune_report.COMMITTED).is_file() else None


def knob_effects(rep: dict | None, family: str, knob_cfg: dict) -> tuple[dict, str]:
    """Each effects knob's advice on the plan's layout family (`effect_stats.family_advice`),
    and its reason; a "set" NCCL or loader value replaces the search's choice in `knob_cfg`
    and "leave" restores the default there (paired effects outrank the search's joint fit)."""
    eff = (rep or {}).get("effects")
    advice = family_advice(eff, family)
    d = (eff or {}).get("families", {}).get(family)
    for knob, a in advice.items():
        value = a["set_value"]
        if knob in ("nccl_algo", "nccl_proto") and a["verdict"] != "not measured":
            table = NCCL_ALGO_ENV if knob == "nccl_algo" else NCCL_PROTO_ENV
            knob_cfg["nccl"][knob.upper()] = table[value] if value is not None else None
        elif knob in LOADER_DEFAULTS and a["verdict"] != "not measured":
            knob_cfg["data_loader"][knob] = value if value is not None else LOADER_DEFAULTS[knob]
    if rep is None:
        where = "no study yet"
    elif d is None:
        have = ", ".join((eff or {}).get("families", {})) or "no family"
        where = f"paired effects measured on {have}, not on {family}"
    else:
        on = f"{ran_on(d)}, " if ran_on(d) else ""
        where = f"{on}{d['pairs']} pairs around {d['base_from']}"
    return advice, (f"the knob study's paired effects on the plan's layout family {family} "
                    f"({where}; variant and base launched back to back, 95% intervals)")


def effects_words(advice: dict, sep: str) -> str:
    """Each measured knob's advice, then the knobs not measured on the family, in one line."""
    said = [f"{k}: {a['advice']}" for k, a in advice.items() if a["verdict"] != "not measured"]
    unsaid = [k for k, a in advice.items() if a["verdict"] == "not measured"]
    return sep.join(said + ([f"{', '.join(unsaid)}: not measured on this layout family"]
                            if unsaid else []))


def knob_settings(rep: dict | None) -> tuple[dict, dict, dict | None]:
    """NCCL and loader settings, their reasons, and the study cited (None: no study yet),
    from a study's report (`study_report`)."""
    nccl = {"NCCL_ALGO": None, "NCCL_PROTO": None}
    loader = dict(LOADER_DEFAULTS)
    if rep is None or not rep["trials"]:
        return ({"nccl": nccl, "data_loader": loader}, {
            "nccl": "defaults: no study yet. NCCL_ALGO and NCCL_PROTO unset: NCCL picks the "
                    "algorithm and protocol per message size from its own cost model, and its "
                    "documentation discourages forcing NCCL_PROTO",
            "data_loader": "defaults: no study yet. 2 workers keep tokenising and collation off "
                           "the training process; prefetch 2 is PyTorch's default with workers; "
                           "pinned memory for asynchronous host-to-GPU copies"}, None)
    by = {r["knob"]: r for r in rep["knobs"]}
    where = (f"study {rep['study']} ({rep['trials']} configurations, {rep['gpu_hours']:.2f} "
             f"GPU-hours, {rep['model']} on {rep['gpus']} x {rep['card']})")
    notes = {}
    for knob, env in (("nccl_algo", "NCCL_ALGO"), ("nccl_proto", "NCCL_PROTO")):
        notes[knob] = _finding(by.get(knob), knob)
        gain = _gain(by.get(knob))
        if gain:
            nccl[env] = (NCCL_ALGO_ENV if knob == "nccl_algo" else NCCL_PROTO_ENV)[gain["level"]]
    for knob in ("num_workers", "prefetch_factor"):
        notes[knob] = _finding(by.get(knob), knob)
        gain = _gain(by.get(knob))
        if gain and gain["level"] != "none":
            loader[knob] = int(gain["level"].split("-")[-1])
    return ({"nccl": nccl, "data_loader": loader},
            {"nccl": f"{where}: " + "; ".join(notes[k] for k in ("nccl_algo", "nccl_proto")),
             "data_loader": f"{where}: " + "; ".join(notes[k] for k in ("num_workers",
                                                                         "prefetch_factor"))},
            {k: rep[k] for k in ("study", "trials", "gpu_hours", "card", "model", "gpus")})


def _gain(row) -> dict | None:
    """The level that beats the default with an interval above 0, if any (the largest)."""
    if not row:
        return None
    better = [e for e in row["effects"] if e["ci_pct"][0] > 0]
    return max(better, key=lambda e: e["effect_pct"]) if better else None


def _finding(row, knob: str) -> str:
    if row is None or not row["effects"]:
        return f"{knob} was not varied or not estimated, so its default stays"
    parts = [f"{e['level']} vs {e['vs']} {e['effect_pct']:+.1f}% (95% CI "
             f"{e['ci_pct'][0]:+.1f} to {e['ci_pct'][1]:+.1f}%)" for e in row["effects"]]
    verdict = "no measurable effect, default kept" if row["verdict"] == "no measurable effect" \
        else ("the best level taken" if _gain(row) else "no level beats the default, kept")
    return f"{knob}: {verdict} ({', '.join(parts)})"


def format_text(out: dict) -> str:
    c, e, r = out["config"], out["estimate"], out["reasons"]
    lines = [f"{out['model']['name']} ({out['model']['params'] / 1e9:.2f}B) on "
             f"{out['request']['gpus']} x {out['request']['gpu']}: {c['strategy']}"]
    items = [("model", out["model"]["name"]), ("parallel", c["parallel"]),
             ("micro_batch", c["micro_batch"]), ("grad_accum", c["grad_accum"]),
             ("global_batch", f"{c['global_batch_tokens']:,} tokens"),
             ("nccl", c["nccl"]), ("data_loader", c["data_loader"]),
             ("knob_effects", effects_words(out["effects"]["knobs"], "; ")),
             ("time_to_train", f"{out['request']['dataset_tokens']:.3g} tokens in "
                               f"{e['steps']:,} steps: {e['days']:.2f} days, "
                               f"{e['gpu_hours']:,.0f} GPU-hours")]
    for key, value in items:
        lines.append(f"  {key}: {value}\n      because {r[key]}")
    return "\n".join(lines)


__all__ = ["suggest", "parse_size", "model_for", "SuggestError", "SpecError"]
