"""The `pack` knob: sampled only on instruction data, reaching the harness as --pack/--pad,
and an objective that counts only the tokens that train."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainplan.errors import SpecError
from trainplan.tune import knobs, study, trial

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "data" / "suites" / "tune-instruct-7b-4gpu.yaml"


class FakeTrial:
    """Answers every categorical with its last choice and every integer with its low end."""

    def __init__(self):
        self.asked = []

    def suggest_categorical(self, name, choices):
        self.asked.append(name)
        return choices[-1]

    def suggest_int(self, name, low, high):
        self.asked.append(name)
        return low


@pytest.mark.parametrize("data, want, flags", [("instruct", False, ["--pad"]),
                                                ("stdlib", None, [])])
def test_pack_is_sampled_on_instruction_data_only(data, want, flags):
    t = FakeTrial()
    cfg = knobs.suggest(t, knobs.space(), world=4, dp=4, data=data)
    assert cfg["pack"] is want and ("pack" in t.asked) is (data == "instruct")
    args = knobs.harness_args(cfg)
    assert [a for a in args if a in ("--pack", "--pad")] == flags


def test_the_instruct_suite_launches_the_7b_on_instruction_records():
    suite = study.make_suite(suite_path=str(SUITE))
    assert suite["model"] == "llama-7b" and suite["gpus"] == 4 and suite["data"] == "instruct"
    cfg = {**{k: v.default for k, v in knobs.SPACE.items()}, "prefetch_factor": None}
    cmd = trial.launch_command(suite, cfg, cpu=False)
    assert cmd[cmd.index("--data") + 1] == "instruct" and "--pack" in cmd
    plain = study.make_suite(suite_path=str(ROOT / "data" / "suites" / "tune-2gpu.yaml"))
    assert "--data" not in trial.launch_command(plain, {**cfg, "pack": None}, cpu=False)


def test_a_suite_with_unknown_data_is_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"model": "llama-1.3b", "gpus": 2, "data": "chat"}))
    with pytest.raises(SpecError, match="suite data 'chat' is not valid"):
        study.make_suite(suite_path=str(path))


def test_the_objective_counts_only_trained_tokens():
    """Same step times: packed rows that train on half their positions beat padded rows
    that train on a tenth, by that ratio; without shares (packed text) nothing changes."""
    def launch(share):
        s = {"tokens_per_step": 8192, "ranks": 2, "step_times_s": [0.5] * 12,
             "tokens_per_s_per_gpu": 8192.0}
        return s if share is None else {**s, "trained_share": [share] * 12}

    packed, padded, text = (trial.pooled([launch(s)]) for s in (0.5, 0.1, None))
    assert text["tokens_per_s_per_gpu"] == pytest.approx(8192.0)
    assert packed["tokens_per_s_per_gpu"] == pytest.approx(4096.0)
    assert packed["tokens_per_s_per_gpu"] / padded["tokens_per_s_per_gpu"] == pytest.approx(5)
