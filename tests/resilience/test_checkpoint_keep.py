"""`--keep` past any real retention is refused, not priced into a 16-digit storage figure."""

from __future__ import annotations

import pytest

from trainplan.cli import main
from trainplan.resilience.checkpoint import MAX_KEEP, CheckpointPlanError, plan_checkpoints

ASKED = {"n_params": 13_015_864_320, "gpus": 32, "node_mtbf_hours": 2000.0,
         "write_gbps_per_node": 2.0, "restart_minutes": 10.0}


@pytest.mark.parametrize("keep", [MAX_KEEP + 1, 10**14])
def test_a_keep_past_the_bound_is_refused_naming_it(keep):
    with pytest.raises(CheckpointPlanError) as err:
        plan_checkpoints(**ASKED, keep=keep)
    assert f"--keep {keep}" in str(err.value) and f"{MAX_KEEP:,}" in str(err.value)


def test_the_bound_itself_is_priced():
    plan = plan_checkpoints(**ASKED, keep=MAX_KEEP)
    assert plan.keep == MAX_KEEP and plan.retention_gb > 0


def test_the_verb_answers_exit_2_in_one_line(capsys):
    argv = ["checkpoint", "--model", "llama-13b", "--gpus", "32", "--node-mtbf-hours", "2000",
            "--write-gbps-per-node", "2", "--restart-minutes", "10", "--keep", "100000000000000"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "--keep 100000000000000" in err and "at most" in err, err
