"""CPU affinity next to the GPU (`bench.affinity`): the cpulist parser, the sysfs path from
a GPU's PCI address, and that asking on a CPU run or a host that cannot tell changes nothing."""

import os
from types import SimpleNamespace

import pytest
import torch

from trainplan.bench.harness import affinity


def test_cpulist_ranges_and_singles():
    assert affinity.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert affinity.parse_cpulist("5") == {5}
    with pytest.raises(ValueError):
        affinity.parse_cpulist("4-2")
    with pytest.raises(ValueError):
        affinity.parse_cpulist("a-b")


def test_pci_path_from_device_properties():
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1b, pci_device_id=0)
    assert affinity.pci_path(props) == affinity.SYSFS / "0000:1b:00.0"
    assert affinity.pci_path(SimpleNamespace(pci_bus_id=3)) is None


def test_cpu_runs_and_mode_none_leave_the_affinity_alone():
    before = os.sched_getaffinity(0)
    for mode in affinity.MODES:
        got = affinity.apply(mode, torch.device("cpu"))
        assert got["mode"] == "none" and got["cpus"] is None
    assert os.sched_getaffinity(0) == before
