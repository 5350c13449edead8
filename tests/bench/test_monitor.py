"""The monitoring hooks: per-step metrics, stragglers and the throughput alert.

One real run: two gloo ranks under `torchrun` train the tiny proxy with rank 1
made slow between steps (TRAINPLAN_FAULT=sleep@step, outside the timed step,
as a slow data loader or host would be), and rank 0's metrics file must name
rank 1, and only it, a straggler, and carry the alert its too-high threshold
asks for. The alert's arithmetic (threshold above the achieved rate fires,
below does not, warm-up never, one line per episode) and the flag checks are
unit tests of `Monitor` in one process, where the step times are given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from trainplan.bench.harness import monitor

LIB = Path(__file__).resolve().parents[2] / "lib"
TINY = "n_layers: 2\nhidden: 32\nn_heads: 4\nn_kv_heads: 2\nffn: 64\nvocab: 128\n"
SLOW_S = 0.3  # rank 1's extra time per step: several times a tiny CPU step


def _args(tmp_path, **kw) -> Namespace:
    base = dict(metrics=str(tmp_path / "metrics.jsonl"), straggler_tolerance=0.10,
                straggler_window=5, alert_tokens_per_s_per_gpu=None, alert_window=3, warmup=2)
    return Namespace(**{**base, **kw})


def _monitor(args, world=1) -> monitor.Monitor:
    return monitor.Monitor(args, tokens_per_step=1000, flops_per_token=1.0, peak=None,
                           device=torch.device("cpu"), rank=0, world=world)


def _run(args, step_times) -> monitor.Monitor:
    m = _monitor(args)
    for i, t in enumerate(step_times, 1):
        m.step(i, t)
    m.finish()
    return m


def test_alert_fires_when_the_threshold_is_above_the_rate(tmp_path, capsys):
    args = _args(tmp_path, alert_tokens_per_s_per_gpu=2000.0)  # achieved: 1000 tokens/s
    m = _run(args, [0.01] * 2 + [1.0] * 6)  # fast warm-up steps are not counted
    frame = monitor.read(args.metrics)
    alerts = frame[frame["alert"].notna()]
    assert m.alerts == 1 and list(alerts["step"]) == [5]  # window of 3 full at step 5, once
    assert alerts["tokens_per_s_per_gpu"].iloc[0] == pytest.approx(1000.0)
    assert "ALERT step 5" in capsys.readouterr().err


def test_no_alert_below_the_rate_or_in_warmup(tmp_path, capsys):
    args = _args(tmp_path, alert_tokens_per_s_per_gpu=500.0, warmup=3)
    m = _run(args, [100.0] * 3 + [1.0] * 5)  # a very slow warm-up: not alerted on
    frame = monitor.read(args.metrics)
    assert m.alerts == 0 and frame["alert"].isna().all()
    assert list(frame["warmup"]) == [True] * 3 + [False] * 5
    assert "ALERT" not in capsys.readouterr().err


def test_alert_again_only_after_recovery(tmp_path):
    args = _args(tmp_path, alert_tokens_per_s_per_gpu=500.0, alert_window=1, warmup=0)
    m = _run(args, [4.0, 4.0, 1.0, 4.0, 4.0])  # 250, 250, 1000, 250, 250 tokens/s
    assert m.alerts == 2


def test_stragglers_from_host_time(tmp_path):
    """Rank 2 starts each step 0.5 s late: its timed step reads short, its own time long."""
    m = _monitor(_args(tmp_path, warmup=0), world=4)
    per_rank = [[1.0, 0.0, float("nan"), float("nan")]] * 4
    per_rank[2] = [0.5, 0.5, float("nan"), float("nan")]
    m.calls = 1
    line = m._record(1, per_rank)
    assert line["stragglers"] == [2] and line["step_time_s"] == 1.0
    assert line["mem_allocated_gib"] is None and line["mfu"] is None
    m.finish()


@pytest.mark.parametrize("flag, value", [("straggler_tolerance", -0.1), ("alert_window", 0),
                                         ("straggler_window", 0),
                                         ("alert_tokens_per_s_per_gpu", 0.0),
                                         ("straggler_tolerance", float("nan")),
                                         ("straggler_tolerance", float("inf")),
                                         ("alert_tokens_per_s_per_gpu", float("inf"))])
def test_bad_flags_name_the_value(tmp_path, flag, value):
    with pytest.raises(monitor.MonitorError, match=f"--{flag.replace('_', '-')} = {value}"):
        monitor.check_args(_args(tmp_path, **{flag: value}))


def test_two_ranks_slow_rank_is_a_straggler(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY)
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRAINPLAN_FAULT=f"sleep@step:*:rank:1:s:{SLOW_S}",
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trainplan.bench.harness.train", "--model", str(model), "--dp", "2",
           "--seq-len", "32",
           "--micro-batch", "2", "--steps", "6", "--warmup", "1", "--synthetic", "--cpu",
           "--json", "--metrics", str(metrics), "--straggler-window", "3",
           "--alert-window", "2", "--alert-tokens-per-s-per-gpu", "1e12"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith('{"model"')))
    assert summary["monitor"] == {"metrics": str(metrics), "alerts": 1}
    frame = monitor.read(metrics)
    steps = frame[frame["alert"].isna()]
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6]
    measured = steps[~steps["warmup"].astype(bool)]
    assert all(s == [1] for s in measured["stragglers"]), measured[["step_s", "host_s"]]
    assert all(len(s) == 2 for s in steps["step_s"])
    assert (measured["tokens_per_s_per_gpu"] > 0).all() and measured["mfu"].isna().all()
    alerts = frame[frame["alert"].notna()]
    assert list(alerts["alert"]) == ["throughput"] and list(alerts["step"]) == [3]
    assert proc.stderr.count("trainplan monitor: ALERT") == 1


def test_launch_flags_follow_the_plan():
    watch = {"alert_tokens_per_s_per_gpu": 2400.4, "straggler_step_time_s": 11.5,
             "step_time_s": 10.0}
    assert monitor.launch_flags(watch, "logs/metrics.jsonl") == [
        "--metrics", "logs/metrics.jsonl", "--alert-tokens-per-s-per-gpu", "2400",
        "--straggler-tolerance", "0.15"]
