"""Fixtures of the harness tests."""

from __future__ import annotations

import os

import pytest


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
