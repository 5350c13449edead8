"""Pin a rank's threads to the CPUs next to its GPU (`--cpu-affinity gpu-local`).

At the proxy's width tensor-parallel blocks are host-bound (their block microbenchmark takes
as long at micro-batch 8 as at micro-batch 1), and launches of one layout spread by a third
in step time. Pinning each rank to the CPUs local to its GPU, as `torchrun --numa-binding
node` does through numactl, tests whether that spread is where the rank's threads land.
Off by default. The CPUs are the GPU's PCI device's `local_cpulist` in sysfs.
"""

from __future__ import annotations

import os
from pathlib import Path

MODES = ("none", "gpu-local")
SYSFS = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}; bad text raises ValueError."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"cpu range {part!r} runs backwards")
        out.update(range(first, last + 1))
    return out


def pci_path(props) -> Path | None:
    """The sysfs folder of a GPU from `torch.cuda.get_device_properties`, None where the
    properties carry no PCI address."""
    ids = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(i is None for i in ids):
        return None
    domain, bus, dev = ids
    return SYSFS / f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def apply(mode: str, device) -> dict:
    """Pin this process to `device`'s local CPUs (mode gpu-local) and say what was done:
    {"mode", "cpus": how many or None, "note"}. Never raises: a host that cannot tell
    leaves the affinity as it was and the note says why."""
    if mode == "none" or getattr(device, "type", "cpu") != "cuda":
        return {"mode": "none", "cpus": None, "note": "affinity left to the OS"}
    import torch

    path = pci_path(torch.cuda.get_device_properties(device))
    listing = path / "local_cpulist" if path else None
    if listing is None or not listing.is_file():
        return {"mode": "none", "cpus": None, "note": f"no local_cpulist for {device}"}
    try:
        cpus = parse_cpulist(listing.read_text()) & os.sched_getaffinity(0)
    except ValueError as err:
        return {"mode": "none", "cpus": None, "note": f"{listing}: {err}"}
    if not cpus:
        return {"mode": "none", "cpus": None,
                "note": f"{listing} names no CPU this process may use"}
    os.sched_setaffinity(0, cpus)
    return {"mode": mode, "cpus": len(cpus), "note": f"pinned to {listing}"}
