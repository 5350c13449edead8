"""A rank's host side (`bench.harness.host`). CPU affinity: the cpulist parser, the sysfs path
from a GPU's PCI address, and that asking on a CPU run or a host that cannot tell changes
nothing. The collector: `--gc step` freezes, disables and collects at step starts, both modes
time collections, and the collector is left as it was found; a CPU run end to end."""

import gc
import os
from types import SimpleNamespace

import pytest
import torch

from trainplan.bench.harness import host


def test_cpulist_ranges_and_singles():
    assert host.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert host.parse_cpulist("5") == {5}
    with pytest.raises(ValueError):
        host.parse_cpulist("4-2")
    with pytest.raises(ValueError):
        host.parse_cpulist("a-b")


def test_pci_path_from_device_properties():
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1b, pci_device_id=0)
    assert host.pci_path(props) == host.SYSFS / "0000:1b:00.0"
    assert host.pci_path(SimpleNamespace(pci_bus_id=3)) is None


def test_cpu_runs_and_mode_none_leave_the_affinity_alone():
    before = os.sched_getaffinity(0)
    for mode in host.MODES:
        got = host.apply(mode, torch.device("cpu"))
        assert got["mode"] == "none" and got["cpus"] is None
    assert os.sched_getaffinity(0) == before


def _cycles(n: int) -> None:
    """Make n reference cycles: garbage only the collector frees."""
    for _ in range(n):
        a: list = []
        a.append(a)


def test_python_mode_times_automatic_collections_and_restores():
    enabled, callbacks = gc.isenabled(), list(gc.callbacks)
    gc.enable()
    try:
        w = host.Watch("python", 1)
        w.start()
        for step in range(3):
            w.boundary(step)
            _cycles(5000)  # passes gen 0's threshold many times
            w.end_step()
        w.stop()
    finally:
        gc.enable() if enabled else gc.disable()
    assert len(w.pause_s) == 3 and all(s > 0 for s in w.pause_s)
    assert w.collections[0] > 0
    assert gc.callbacks == callbacks


def test_step_mode_freezes_disables_and_collects_at_boundaries():
    before = gc.isenabled()
    w = host.Watch("step", 2)
    w.start()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        for step in range(4):
            w.boundary(step)
            _cycles(100)
            w.end_step()
        assert w.collections[1] == 2  # steps 0 and 2, nothing automatic
        assert w.collections[0] == 0 and w.collections[2] == 0
        assert w.pause_s[0] > 0 and w.pause_s[1] == 0.0
    finally:
        w.stop()
    assert gc.isenabled() == before and gc.get_freeze_count() == 0


def test_summary_splits_warmup_and_reduces_over_ranks():
    w = host.Watch("python", 1)
    w.pause_s, w.collections = [0.5, 0.1, 0.2, 0.3], [7, 2, 1]
    doubled = host.Watch.summary(w, lambda v: [2 * x for x in v], warmup=1)
    assert doubled["warmup_pause_s"] == [1.0] and doubled["pause_s"] == [0.2, 0.4, 0.6]
    assert doubled["collections"] == [14, 4, 2] and doubled["mode"] == "python"


def test_a_cpu_run_under_gc_step_reports_its_collections(tmp_path):
    import yaml

    from trainplan.bench.harness import train

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"n_layers": 2, "hidden": 64, "n_heads": 4, "n_kv_heads": 2,
                                    "ffn": 128, "vocab": 256}))
    summary = train.run(train.parse_args(["--model", str(path), "--seq-len", "32", "--steps", "6",
                                          "--warmup", "2", "--synthetic", "--cpu", "--json",
                                          "--gc", "step"]))
    got = summary["gc"]
    assert got["mode"] == "step" and len(got["pause_s"]) == 4 and len(got["warmup_pause_s"]) == 2
    assert got["collections"][1] >= 6 and got["collections"][2] == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_every_below_one_is_one_line_and_exit_2(capsys):
    from trainplan.bench.harness import train

    assert train.main(["--model", "llama-1.3b", "--gc-every", "0", "--synthetic", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "--gc-every = 0" in err


def test_step_mode_collects_everything_every_full_every_steps():
    w = host.Watch("step", 1, full_every=2)
    w.start()
    try:
        for step in range(5):
            w.boundary(step)
            w.end_step()
    finally:
        w.stop()
    assert w.collections == [0, 3, 2]  # young at 0, 1, 3; full at 2, 4
