"""Fixtures of the harness tests."""

from __future__ import annotations

import os

import pytest

from .micro_runs import shared_micro

# the tiny model of the host-time benches (test_micro_host.py, test_micro_step.py)
HOST_TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 4\nffn: 128\nvocab: 256\n"


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One cache directory for the whole run, shared by xdist workers (the build is locked)."""
    path = tmp_path_factory.getbasetemp().parent / "trainplan-cache"
    old = os.environ.get("TRAINPLAN_CACHE")
    os.environ["TRAINPLAN_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TRAINPLAN_CACHE", None)
    else:
        os.environ["TRAINPLAN_CACHE"] = old


@pytest.fixture(scope="session")
def host_launch(tmp_path_factory) -> list[dict]:
    """The records of one real torchrun launch of 2 gloo ranks, benches `host,host-step`:
    the host blocks (test_micro_host.py reads them), then the whole tiny model's steps
    (test_micro_step.py). Once per session: a launch of `host` alone runs the same block
    tasks (`_tasks`, checked in test_micro_step.py), so it would only repeat them."""
    every, _ = shared_micro(tmp_path_factory, "host", HOST_TINY, 2, "--benches", "host,host-step",
                            "--warmup", "1", "--iters", "2", "--repeats", "6",
                            "--block-repeats", "6", "--seq-len", "32",
                            "--host-step-layers", "1", timeout=600)
    return every
