"""What `trainplan launch` takes besides the plan, checked: the trainer flags passed on with
--train-arg, the --env settings, the run's length, and the spec files the job reads.

A --train-arg may not set a flag that launch writes itself (the trainer would take the last
of the two), nor one twice; an --env name may not be given twice. `spec_file` names the file
a spec argument reads, so that `folder.check_inputs` can keep --out off it.
"""

from __future__ import annotations

import argparse
import os
from functools import cache
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.loader import quote
from trainplan.specs import DATA_DIR, SLICE

# --steps' bound: the trainer has none of its own; a billion steps is years of training at
# any step time the planner prices, so more is a typo, not a run
MAX_STEPS = 10**9
STEPS_WORDS = "0: from the scenario's token budget; at most 1e9 steps"

_LAYOUT = ("dp", "tp", "pp", "cp", "ep", "zero", "dp-shard", "micro-batch", "grad-accum",
           "recompute", "pp-schedule", "pp-virtual")
# The trainer flags launch writes into the job itself (`artefacts.harness_args`, the monitor,
# checkpoint and timeout flags) -> the launch flag that sets them, or why none does.
OWNED = {
    **{f"--{k}": f"its --{k}" for k in ("model", "data", "seq-len", "steps", "ckpt-every",
                                               "ckpt-keep", "collective-timeout-s", "cpu")},
    **{f"--{k}": f"the plan's layout (pin it with its --{k})" for k in _LAYOUT},
    "--no-sequence-parallel": "the plan's layout",
    "--compile": "its --no-compile and --cpu",
    "--log-dir": "the script's LOG_DIR",
    "--ckpt-dir": "the script's CKPT_DIR",
    "--ckpt-async": "the checkpoint plan", "--resume": "the checkpoint plan",
    **{f"--{k}": "the plan's alert line" for k in ("metrics", "alert-tokens-per-s-per-gpu",
                                                   "straggler-tolerance")},
}
PATH_FLAGS = ("--tokenizer", "--init-from")  # trainer flags naming a file or folder it reads


class InputError(TrainplanError):
    """A --train-arg or --env that would set one thing twice, or a run too long."""


@cache
def _trainer_flags() -> tuple[str, ...]:
    """The long flags of `python -m trainplan.train` (its argparse setup: no torch)."""
    from trainplan.train.flags import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return tuple(o for a in parser._actions for o in a.option_strings if o.startswith("--"))


def trainer_flag(name: str) -> str:
    """The trainer flag `--NAME` stands for: itself, or the one flag it abbreviates (as the
    trainer's argparse reads it); an unknown or ambiguous one as it is (the trainer refuses)."""
    flag = f"--{name.replace('_', '-')}"
    flags = _trainer_flags()
    longer = [f for f in flags if f.startswith(flag)]
    return flag if flag in flags or len(longer) != 1 else longer[0]


def train_args(items: list[str]) -> tuple[str, ...]:
    """The trainer flags of --train-arg FLAG=VALUE items, each flag written out in full; one
    line for an item that is not FLAG=VALUE, sets a flag launch writes itself (`OWNED`) or
    sets one an earlier item set."""
    out, seen = [], {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value or "\n" in item or name.startswith("-"):
            raise InputError(f"--train-arg {quote(item)} is not valid; use FLAG=VALUE without "
                             "dashes, e.g. lr=2e-4")
        flag = trainer_flag(name)
        if flag in OWNED:
            raise InputError(f"--train-arg {quote(item)} sets the trainer's {flag}, which launch "
                             f"writes itself from {OWNED[flag]}; leave the --train-arg out")
        if flag in seen:
            raise InputError(f"--train-arg {quote(item)} sets the trainer's {flag} again (after "
                             f"--train-arg {quote(seen[flag])}); give it once")
        seen[flag] = item
        out += [flag, value]
    return tuple(out)


def train_arg_paths(args: tuple[str, ...]) -> list[tuple[str, str]]:
    """(how it was named, path) of each file or folder `train_args` flags name (`PATH_FLAGS`)."""
    return [(f"--train-arg {flag[2:]}", value) for flag, value in zip(args[::2], args[1::2],
                                                                        strict=True)
            if flag in PATH_FLAGS]


def env_settings(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """--env NAME=VALUE pairs as a dict; one line for a NAME given twice."""
    out: dict[str, str] = {}
    for name, value in pairs:
        if name in out:
            raise InputError(f"--env {quote(name)} is given twice ({quote(f'{name}={out[name]}')}"
                             f" and {quote(f'{name}={value}')}); give it once")
        out[name] = value
    return out


def spec_file(name: str, kind: str) -> Path | None:
    """The file (or Hugging Face folder) a spec argument reads: the preset of that name under
    data/`kind`, else the path given where something is there; None where neither is."""
    sliced = SLICE.fullmatch(name)
    name = sliced["base"] if sliced else name
    preset = DATA_DIR / kind / f"{name}.yaml"
    try:
        if os.sep not in name and preset.is_file():
            return preset
        return Path(name) if os.path.lexists(name) else None
    except (OSError, ValueError):  # a name the OS cannot look at: the spec's loader says so
        return None
