"""A job that fails within a restart plus a save is refused, not given an interval of "0.0 min".

`cycle.outlives_restart`: the forms assume failures strike only while the job trains, so
they need the job MTBF M above the restart R plus one save's persist time T_p. Below it the
refusal names the GPU count, the job MTBF, R and T_p, and the largest GPU count that fits.
"""

from __future__ import annotations

import re

import pytest

from conftest import trainplan_cli
from trainplan.cli import MAX_LINE, main
from trainplan.errors import TrainplanError
from trainplan.resilience.checkpoint import (
    CheckpointPlanError,
    describe_interval,
    digits,
    plan_checkpoints,
)
from trainplan.resilience.cycle import outlives_restart
from trainplan.resilience.failures import simulate

N13 = 13_015_864_320  # llama-13b
ASKED = dict(n_params=N13, node_mtbf_hours=2000.0, write_gbps_per_node=2.0, restart_minutes=10.0)
CLI = ["checkpoint", "--model", "llama-13b", "--node-mtbf-hours", "2000",
       "--write-gbps-per-node", "2", "--restart-minutes", "10"]
MOST = 95_992  # 11,999 nodes: 2000 h / 11,999 = 600.05 s > 600 s + T_p; 12,000 nodes: 600 s


def refused(argv, capsys) -> str:
    """The one stderr line of a refused `trainplan` command (exit 2, nothing on stdout)."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    assert err.startswith("trainplan: error: ") and err.count("\n") == 1, err
    return err


def test_the_condition_is_strict():
    assert not outlives_restart(600.0, 600.0, 0.0)
    assert not outlives_restart(600.0, 590.0, 10.0)
    assert outlives_restart(600.001, 590.0, 10.0)


@pytest.mark.parametrize(("gpus", "nodes", "mtbf"), [
    (1_048_576, "131,072 nodes", "54.9 s"),
    (96_000, "12,000 nodes", "600 s"),  # M = R exactly: refused
    (9_007_199_254_740_992, "1,125,899,906,842,624 nodes", "6.39e-09 s"),
])
def test_too_many_gpus_are_refused_naming_what_fits(capsys, gpus, nodes, mtbf):
    err = refused([*CLI, "--gpus", str(gpus)], capsys)
    for part in (f"--gpus {gpus} ({nodes})", f"the job's MTBF, {mtbf},", "restart (10 min)",
                 f"use at most {MOST:,} GPUs", "--node-mtbf-hours 2000 is too short"):
        assert part in err, (part, err)
    assert "0.0 min" not in err


def test_the_headline_case_in_a_real_process(tmp_path):
    r = trainplan_cli([*CLI, "--gpus", "1048576"], tmp_path)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert "--gpus 1048576" in r.stderr and f"at most {MOST:,} GPUs" in r.stderr
    assert "a node MTBF above 21,846 h" in r.stderr  # 131,072 x 600.0006 s = 21,845.4 h


def test_one_node_that_fails_too_often_names_the_mtbf_needed(capsys):
    err = refused([*CLI, "--gpus", "8", "--node-mtbf-hours", "0.1"], capsys)
    assert "--node-mtbf-hours 0.1 is too short for --gpus 8 (1 node)" in err
    assert "use at most" not in err  # no GPU count helps: one node already fails
    need = float(re.search(r"node MTBF above ([\d.,]+) h", err)[1].replace(",", ""))
    assert plan_checkpoints(**{**ASKED, "node_mtbf_hours": need}, gpus=8).interval_min > 0


@pytest.mark.parametrize("kw", [{}, {"mode": "sync"}, {"shard_gpus": 8}, {"bf16_weights": True},
                                {"restart_minutes": 1.0}, {"node_mtbf_hours": 50.0}])
def test_the_largest_count_named_is_planned_and_one_node_more_is_not(kw):
    asked = {**ASKED, **kw}
    with pytest.raises(CheckpointPlanError) as err:
        plan_checkpoints(**asked, gpus=2**40)
    text = str(err.value)
    assert "\n" not in text and "--gpus 1099511627776" in text
    most = int(re.search(r"use at most ([\d,]+) GPUs", text)[1].replace(",", ""))
    plan = plan_checkpoints(**asked, gpus=most)
    assert plan.interval_min > 0 and plan.job_mtbf_hours * 60 > plan.restart_min
    with pytest.raises(CheckpointPlanError, match=f"--gpus {most + 8} "):
        plan_checkpoints(**asked, gpus=most + 8)


@pytest.mark.parametrize("shard", [32, 128, 3200])
def test_with_shard_gpus_the_count_named_is_one_it_divides(shard):
    """--shard-gpus S must divide --gpus: the count named is the largest that plans with S."""
    with pytest.raises(CheckpointPlanError) as err:
        plan_checkpoints(**ASKED, gpus=320_000, shard_gpus=shard)
    most = int(re.search(r"use at most ([\d,]+) GPUs", str(err.value))[1].replace(",", ""))
    assert most % shard == 0 and plan_checkpoints(**ASKED, gpus=most, shard_gpus=shard)
    with pytest.raises(CheckpointPlanError, match=f"too short for --gpus {most + shard} "):
        plan_checkpoints(**ASKED, gpus=most + shard, shard_gpus=shard)  # the next S divides


@pytest.mark.parametrize(("flags", "interval"), [
    (["--gpus", str(MOST)], "interval        0.0047 min"),  # 0.28 s: stalls of 65 us
    (["--gpus", "32", "--write-gbps-per-node", "1e6", "--sync"], "interval        0.2 min"),
])
def test_small_positive_values_are_never_printed_as_zero(capsys, flags, interval):
    assert main([*CLI, *flags]) == 0
    text = capsys.readouterr().out
    assert interval in text, text
    assert not re.search(r"(?<![\d.])0\.0+ (min|s|h|GB)\b", text), text


@pytest.mark.parametrize(("gpus", "sentence"), [
    (32, "The interval is Daly's optimum, 14.0 minutes"),
    (MOST, "The interval is Daly's optimum, 0.0047 minutes")])
def test_the_runbook_sentence_keeps_the_digits_too(gpus, sentence):
    assert describe_interval(plan_checkpoints(**ASKED, gpus=gpus)).startswith(sentence)


@pytest.mark.parametrize(("value", "places", "shown"), [
    (0.0, 1, "0.0"), (14.04, 1, "14.0"), (0.1, 1, "0.1"), (0.0047, 1, "0.0047"),
    (6.5e-05, 2, "6.5e-05"), (0.2, 2, "0.20"), (12345.6, 1, "12,345.6")])
def test_numbers_keep_their_digits(value, places, shown):
    assert digits(value, places) == shown


@pytest.mark.parametrize(("job_mtbf_hours", "restart_min", "persist_s"), [
    (1 / 6, 10.0, 0.0066), (0.01, 10.0, 60.0), (0.1, 5.0, 60.0)])
def test_the_simulation_refuses_the_same_regime(job_mtbf_hours, restart_min, persist_s):
    with pytest.raises(CheckpointPlanError, match=f"job_mtbf_hours = {job_mtbf_hours:g} ") as err:
        simulate(10.0, interval_min=30.0, stall_s=persist_s / 2, persist_s=persist_s,
                 restart_min=restart_min, job_mtbf_hours=job_mtbf_hours, runs=10)
    assert "\n" not in str(err.value) and f"({restart_min:g} min)" in str(err.value)


BAD = [  # (flag, value, fragment of the one line)
    ("--gpus", "0", "--gpus: '0' is not valid: it must be > 0"),
    ("--gpus", "-8", "--gpus: '-8'"),
    ("--gpus", "1.5", "--gpus: '1.5' is not a positive whole number"),
    ("--gpus", "1e300", "--gpus: '1e300' is too large"),
    ("--gpus-per-node", "0", "--gpus-per-node: '0'"),
    ("--node-mtbf-hours", "-1", "--node-mtbf-hours: '-1'"),
    ("--node-mtbf-hours", "inf", "--node-mtbf-hours: 'inf'"),
    ("--node-mtbf-hours", "1e300", "--node-mtbf-hours 1e+300 is out of range"),
    ("--write-gbps-per-node", "nan", "--write-gbps-per-node: 'nan'"),
    ("--write-gbps-per-node", "1e300", "--write-gbps-per-node 1e+300 is out of range"),
    ("--write-gbps-per-node", "1e-300", "--write-gbps-per-node 1e-300"),
    ("--restart-minutes", "0", "--restart-minutes: '0'"),
    ("--restart-minutes", "1e300", "--restart-minutes 1e+300 is out of range"),
    ("--max-lost-minutes", "-30", "--max-lost-minutes: '-30'"),
    ("--host-copy-gbps", "1e-300", "--host-copy-gbps"),
    ("--host-copy-gbps", "1e300", "--host-copy-gbps 1e+300 is out of range"),
    ("--keep", "0", "--keep: '0'"),
    ("--keep", "2.5", "--keep: '2.5' is not a positive whole number"),
    ("--keep", "1", "--keep 1 is not valid"),
    ("--keep", "1e300", "--keep: '1e300' is too large"),
]


@pytest.mark.parametrize(("flag", "value", "fragment"), BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_bad_values_are_one_line_naming_them(capsys, flag, value, fragment):
    argv = [*CLI, "--gpus", "32"]
    argv = argv[:argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2:] if (
        flag in argv) else [*argv, flag, value]
    assert fragment in refused(argv, capsys)


# ---------------------------------------------------------------- launch's and page 5's words

HSDP = {"tp": 1, "pp": 1, "dp_shard": 8, "zero": 3}  # the state split over a node


@pytest.mark.parametrize(("gpus", "nodes"), [(80_000, "10,000"), (100_000, "12,500"),
                                             (1_048_576, "131,072")])
def test_launch_and_page_5_name_the_gpus_not_the_checkpoint_flags(gpus, nodes):
    """`launch.job.checkpoint_plans` (launch, pages 5 and 6) plans with page 5's node MTBF and
    restart, which no flag there sets: its line names the GPU count and the most that plan,
    and is a class of `trainplan.errors`, on which the runbook's build exits 2."""
    from trainplan.launch import job
    from trainplan.runbook.build import _error_names
    from trainplan.specs import load_model

    m = load_model("llama-13b")
    with pytest.raises(TrainplanError) as err:
        job.checkpoint_plans(m, gpus, 8, HSDP)
    text = str(err.value)
    assert type(err.value).__name__ in _error_names()
    assert "\n" not in text and len(f"trainplan: error: {text}") <= MAX_LINE, text
    assert text.startswith(f"gpus {gpus} is too many to checkpoint: at page 5's conservative "
                           f"node MTBF (1,536 h) its {nodes} nodes fail every "), text
    assert "the assumed 10-min restart" in text and "--node-mtbf-hours" not in text, text
    most = int(re.search(r"; use at most ([\d,]+) GPUs \(launch --gpus N, runbook -p gpus=N\)$",
                         text)[1].replace(",", ""))
    assert job.checkpoint_plans(m, most, 8, HSDP)["conservative"].interval_min > 0
    with pytest.raises(TrainplanError, match=f"^gpus {most + 8} is too many"):
        job.checkpoint_plans(m, most + 8, 8, HSDP)


def test_the_checkpoint_verb_still_names_its_own_flags(capsys):
    err = refused([*CLI, "--gpus", "100000", "--node-mtbf-hours", "1536"], capsys)
    assert "--node-mtbf-hours 1536 is too short for --gpus 100000" in err
    assert err.rstrip().endswith("or a faster restart"), err
