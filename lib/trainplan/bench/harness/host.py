"""A rank's process on its host: which CPUs its threads run on (`--cpu-affinity`) and when
Python's garbage collector runs (`--gc`).

Affinity. At the proxy's width tensor-parallel blocks are host-bound, and launches of one
layout spread by a third in step time. `gpu-local` pins each rank to the CPUs local to its GPU
(its PCI device's `local_cpulist` in sysfs), as `torchrun --numa-binding node` does through
numactl. Off by default.

Collector. CPython collects when a generation's allocation count passes its threshold: on
whichever rank gets there first, in whichever step. In a host-bound step a collection slows
that rank alone and every rank waits for it at the next collective, so the more ranks, the more
steps hold someone's collection. `--gc step` (the default) collects once after set-up and
freezes what survives (`gc.freeze`: model, compiled graphs and loader are not scanned again),
turns automatic collection off, and collects the young generations (`gc.collect(1)`) at the
start of every `--gc-every`-th step, inside the timed region; every `--gc-full-every`-th step
(1000) it collects all but the frozen objects, so a long job's cyclic garbage does not pile
up. `--gc python` leaves the collector as CPython runs it: a full collection of a compiled
1.3B run took 0.27-0.36 s on an H200 host (data/measurements/gc-h200x2-20261128/). Both
modes time every collection through `gc.callbacks`.

Allocator. `allocator_env` sets PyTorch's CUDA caching allocator to expandable segments
before CUDA starts, unless the user set the allocator's variable: one segment per stream that
grows by mapping pages, so blocks freed in one size serve requests of another, where the
default strands them (data/measurements/allocator-h200-20261128/).
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from pathlib import Path

from trainplan.bench.flags import GC_DEFAULTS, add_gc_arguments
from trainplan.cost import memory_runtime as rt
from trainplan.errors import TrainplanError

MODES = ("none", "gpu-local")  # --cpu-affinity
PINNED: dict = {}  # what train.init_distributed had `apply` do to this process
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


def add_arguments(p) -> None:
    """--cpu-affinity, and the collector's flags (`bench.flags.add_gc_arguments`)."""
    p.add_argument("--cpu-affinity", default="none", choices=MODES,
                   help="gpu-local: pin each rank to the CPUs next to its GPU (sysfs "
                        "local_cpulist)")
    add_gc_arguments(p)


def check_args(args) -> None:
    if args.gc != "step":  # the schedule is --gc step's
        for name, default in GC_DEFAULTS.items():
            if getattr(args, name) != default:
                raise TrainplanError(f"--{name.replace('_', '-')} {getattr(args, name)} is "
                                     f"--gc step's schedule; with --gc {args.gc} leave it out")
    for name in ("gc_every", "gc_full_every"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise TrainplanError(f"{flag} = {getattr(args, name)} must be >= 1 (steps between "
                                 "collections)")


class Watch:
    """Seconds spent in the collector per step, and collections by generation, for one
    rank; `boundary` runs the scheduled collection of `--gc step`."""

    def __init__(self, mode: str, every: int, full_every: int = 1000):
        self.mode, self.every, self.full_every = mode, every, full_every
        self.pause_s: list[float] = []  # per step, this rank
        self.collections = [0, 0, 0]  # by generation, this rank, whole loop
        self._open = 0.0
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._open += time.perf_counter() - self._started
            self._started = None
            self.collections[min(int(info.get("generation", 2)), 2)] += 1

    def start(self) -> None:
        if self.mode == "step":
            gc.collect()
            gc.freeze()
            gc.disable()
        gc.callbacks.append(self._callback)

    def boundary(self, step: int) -> None:
        """At the start of a timed step (0-based `step`): the scheduled collection. A
        collection between timed regions counts in `collections` only."""
        self._open = 0.0
        if self.mode != "step":
            return
        if step and step % self.full_every == 0:
            gc.collect()  # the frozen set-up objects are not scanned
        elif step % self.every == 0:
            gc.collect(1)

    def end_step(self) -> None:
        self.pause_s.append(self._open)
        self._open = 0.0

    def stop(self) -> None:
        """Leave the collector as it was found (a sweep runs the next config in this process)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self.mode == "step":
            gc.enable()
            gc.unfreeze()

    def summary(self, over_ranks, warmup: int) -> dict:
        """{"mode", "every", "pause_s": kept steps' collector seconds (max over ranks),
        "warmup_pause_s", "collections": [gen 0, 1, 2] (max over ranks)}. `over_ranks`
        reduces a list of floats with MAX across ranks (train.over_ranks)."""
        per_step = over_ranks(self.pause_s) if self.pause_s else []
        counts = over_ranks([float(c) for c in self.collections])
        cut = min(warmup, max(len(per_step) - 1, 0))
        return {"mode": self.mode, "every": self.every,
                "pause_s": [round(s, 6) for s in per_step[cut:]],
                "warmup_pause_s": [round(s, 6) for s in per_step[:cut]],
                "collections": [int(c) for c in counts]}


@contextmanager
def watch(args):
    """The step loop's collector policy and timing (`--gc`, `--gc-every`), undone on exit."""
    w = Watch(getattr(args, "gc", "step"), getattr(args, "gc_every", 1),
              getattr(args, "gc_full_every", 1000))
    w.start()
    try:
        yield w
    finally:
        w.stop()


def summary(args, gcw: Watch, over_ranks) -> dict:
    """The run summary's host fields: "cpu_affinity" (what pinning did, None where not asked)
    and "gc" (`Watch.summary`)."""
    pinned = dict(PINNED) if args.cpu_affinity != "none" else None
    return {"cpu_affinity": pinned, "gc": gcw.summary(over_ranks, args.warmup)}


def allocator_env(environ) -> str:
    """Set PYTORCH_CUDA_ALLOC_CONF to expandable segments in `environ` where neither it nor
    PYTORCH_ALLOC_CONF is set, so the run holds what the planner prices
    (`cost.memory_runtime.allocator_of`) and the records' provenance says so; a user's own
    setting is kept. Returns the mode it leaves."""
    if not any(k in environ for k in rt.ALLOC_CONF_ENVS):
        environ[rt.ALLOC_CONF_ENV] = rt.EXPANDABLE_CONF
    return rt.allocator_of(environ)
