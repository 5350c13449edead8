"""Single-process checks of the checkpoint pieces (seconds, no torchrun).

Flags and fault specs are refused with one line naming the value; the
manifest marks a folder complete and catches damage; retention keeps k and
never touches a save in flight; RNG state and data position round-trip; a
1-rank save and resume restores model, optimizer and RNG exactly; the loader
refuses a checkpoint entry that is not a tensor (DCP would unpickle it).
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from trainplan.bench.ckpt import faults
from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt import store as ckpt
from trainplan.bench.harness import feed
from trainplan.bench.harness.parallelize import Parallelized


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ckpt.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" if v is not True
                         else f"--{k.replace('_', '-')}" for k, v in kw.items()])


@pytest.mark.parametrize("kw, words", [
    ({"ckpt_dir": "d", "ckpt_keep": 1}, "--ckpt-keep = 1"),
    ({"ckpt_dir": "d", "ckpt_every": -2}, "--ckpt-every = -2"),
    ({"resume": True}, "--resume needs --ckpt-dir"),
    ({"ckpt_threads": 4}, "--ckpt-threads 4 needs --ckpt-dir"),
    ({"ckpt_dir": "d", "collective_timeout_s": 0}, "--collective-timeout-s = 0"),
    ({"ckpt_dir": "d", "collective_timeout_s": "nan"}, "--collective-timeout-s = nan"),
])
def test_bad_checkpoint_flags_are_refused_in_one_line(kw, words):
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.check_args(_args(**kw))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_fault_specs_parse_and_bad_ones_name_the_clause():
    clauses = faults.parse("kill@step:7:rank:1; kill@save:writing:step:6;"
                           "kill@random:mtbf:10:seed:7:max:3;sleep@step:*:s:0.4:restart:*")
    assert [(c.action, c.point) for c in clauses] == [
        ("kill", "step"), ("kill", "save:writing"), ("kill", "random"), ("sleep", "step")]
    assert clauses[0].matches("step", 7, 1, 0) and not clauses[0].matches("step", 7, 0, 0)
    assert not clauses[0].matches("step", 7, 1, 1)  # a restarted group is not faulted again
    assert clauses[3].matches("step", 99, 0, 5)
    for bad in ("explode@step:1", "kill@stpe:1", "kill@step:1:rank", "kill@step:1:colour:red"):
        with pytest.raises(faults.FaultSpecError, match="TRAINPLAN_FAULT clause"):
            faults.parse(bad)


def test_manifest_verification_and_retention(tmp_path, no_signal_handlers):
    model, opt = _trained()
    saver = ckpt.Checkpointer(_args(ckpt_dir=tmp_path, ckpt_keep=50),
                              Parallelized(parts=[model]), opt, rank=0, world=1,
                              device=torch.device("cpu"))
    for step in (2, 4, 6, 8):
        saver.save(step)
    saver.join_prune()
    (tmp_path / mf.step_name(3)).mkdir()  # an old unfinished save
    (tmp_path / mf.step_name(10)).mkdir()  # a save in flight
    manifest, why = mf.verify(tmp_path / mf.step_name(8))
    assert why == "" and manifest["step"] == 8
    removed = mf.prune(tmp_path, keep=2)
    assert sorted(removed) == ["step-000002", "step-000003", "step-000004"]
    assert [d.name for _, d in mf.step_dirs(tmp_path)] == ["step-000010", "step-000008",
                                                          "step-000006"]
    (tmp_path / mf.step_name(8) / ".metadata").write_bytes(b"meta!")
    path, _, line = mf.choose(tmp_path)
    assert path.name == "step-000006"
    assert "step-000010: no manifest" in line and "step-000008: .metadata is 5 bytes" in line


def test_rng_state_round_trips_through_json(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = mf.rank_state(5, 0, 1, torch.device("cpu"))
    mf.write_json(tmp_path / "r.json", state)
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    mf.restore_rank_state(mf.json.loads((tmp_path / "r.json").read_text()), torch.device("cpu"))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_data_position_resumes_the_same_sample_stream():
    synth = dict(vocab=50, seq_len=8, micro_batch=2, grad_accum=2, dp_rank=0, dp=1, seed=0)
    whole, resumed = iter(feed.SyntheticBatches(**synth)), iter(feed.SyntheticBatches(**synth,
                                                                                     start=3))
    for _ in range(3):
        next(whole)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(next(whole), next(resumed), strict=True))

    from trainplan.bench.harness.data import SyntheticDataset

    def loader_batches(start):  # 5 batches an epoch: start 3 x 2 = epoch 1, batch 1
        src = feed.LoaderBatches.__new__(feed.LoaderBatches)
        dataset = SyntheticDataset(seq_len=8, vocab=50, seed=0, n=10)
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        src.grad_accum, src.start = 2, start
        src.loader = DataLoader(dataset, batch_size=2, sampler=sampler, drop_last=True)
        return iter(src)

    whole, resumed = loader_batches(0), loader_batches(3)
    for _ in range(3):
        next(whole)
    for _ in range(4):  # across the next epoch boundary too
        assert all(torch.equal(a[0], b[0])
                   for a, b in zip(next(whole), next(resumed), strict=True))


@pytest.fixture
def no_signal_handlers(monkeypatch):
    """Keep the test process's SIGTERM and excepthook as they are."""
    monkeypatch.setattr(faults.Signals, "install", classmethod(lambda cls: None))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


def _trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_one_rank_save_and_resume_restore_model_optimizer_and_rng(tmp_path,
                                                                   no_signal_handlers):
    model, opt = _trained()
    saver = ckpt.Checkpointer(_args(ckpt_dir=tmp_path), Parallelized(parts=[model]), opt,
                              rank=0, world=1, device=torch.device("cpu"))
    saver.save(3)
    after_save = torch.rand(4)
    assert mf.verify(tmp_path / "step-000003")[0]["step"] == 3

    fresh, fresh_opt = _trained(seed=1)
    with pytest.raises(ckpt.CheckpointError, match="already holds checkpoints"):
        ckpt.Checkpointer(_args(ckpt_dir=tmp_path), Parallelized(parts=[fresh]), fresh_opt,
                          rank=0, world=1, device=torch.device("cpu")).resume()
    loader = ckpt.Checkpointer(_args(ckpt_dir=tmp_path, resume=True),
                               Parallelized(parts=[fresh]), fresh_opt, rank=0, world=1,
                               device=torch.device("cpu"))
    assert loader.resume() == 3
    assert torch.equal(torch.rand(4), after_save)  # RNG as it was at the save
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_non_tensor_entry_is_refused_not_unpickled(tmp_path, no_signal_handlers):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _trained()
    folder = tmp_path / "step-000001"
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": {k: "not a tensor" for k in model_sd}, "optim": {"state": optim_sd["state"]}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    saver = ckpt.Checkpointer(_args(ckpt_dir=tmp_path / "other"), Parallelized(parts=[model]),
                              opt, rank=0, world=1, device=torch.device("cpu"))
    with pytest.raises(ckpt.CheckpointError, match="is not a tensor"):
        saver._load(folder, {"step": 1, "world_size": 1})


def test_the_async_stager_survives_being_closed_after_each_stage_as_torch_2_11_does():
    """torch 2.11's DefaultStager closes its inner stager after every stage; reused, the
    second save failed with KeyError: <class 'type'> (seen on H200s). Ours keeps it."""
    from trainplan.bench.ckpt import dcp_io

    stager = dcp_io.make_stager(torch.device("cpu"))
    if stager is None:
        pytest.skip("this torch has no DefaultStager")
    state = {"model": {"w": torch.arange(4.0)}, "optim": {"state": {"w": {"step": torch.ones(())}}}}
    for step in range(3):
        state["model"]["w"] += step
        staged = stager.stage(state)
        stager._state_dict_stager.close()  # what torch 2.11's DefaultStager._stage does
        assert torch.equal(staged["model"]["w"], state["model"]["w"])
    stager.close()
    assert not stager._state_dict_stager._deepcopy_dispatch, "close() must really close it"
