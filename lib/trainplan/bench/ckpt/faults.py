"""What happens to a run from outside: injected faults and preemption signals.

Injected faults prove the checkpointing guarantees (tests/faults/). They are read from one
place, $TRAINPLAN_FAULT, once per process, so a run without it takes none of these paths;
its grammar (ACTION@POINT[:KEY:VALUE]..., e.g. `kill@save:writing:step:6`) is in
bench/README.md, "Injected faults". $TRAINPLAN_DIGEST lists steps after which a hash of
the whole model and optimizer state is logged, for tests to compare with an uninterrupted
run. `Signals` turns SIGTERM (preemption) and SIGUSR1 (Slurm's warning) into a flag the
training loop reads between steps, so the emergency checkpoint is taken at a step boundary
where every rank agrees, not inside a collective.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import signal
import threading
import time
from dataclasses import dataclass, field

from trainplan.errors import TrainplanError

ENV = "TRAINPLAN_FAULT"
DIGEST_ENV = "TRAINPLAN_DIGEST"
ACTIONS = ("kill", "hang", "oserror", "full", "term", "usr1", "sleep")
POINTS = ("step", "random", "save:staging", "save:writing", "save:metadata", "save:manifest",
          "save:committed")
KEYS = ("step", "rank", "restart", "s", "mtbf", "seed", "max")


class FaultSpecError(TrainplanError):
    """TRAINPLAN_FAULT does not parse."""


@dataclass
class Clause:
    action: str
    point: str
    keys: dict[str, str] = field(default_factory=dict)

    def matches(self, point: str, step: int, rank: int, attempt: int) -> bool:
        k = self.keys
        return (self.point == point and _hit(k.get("step", "*"), step)
                and _hit(k.get("rank", "*"), rank) and _hit(k.get("restart", "0"), attempt))


def _hit(want: str, value: int) -> bool:
    return want == "*" or int(want) == value


def parse(spec: str) -> list[Clause]:
    """The clauses of a TRAINPLAN_FAULT value; FaultSpecError names the bad part."""
    clauses = []
    for text in filter(None, (c.strip() for c in spec.split(";"))):
        action, at, rest = text.partition("@")
        tokens = rest.split(":")
        if action not in ACTIONS or not at:
            raise FaultSpecError(f"{ENV} clause {text!r}: action must be one of {ACTIONS}, "
                                 "followed by @POINT")
        if tokens[0] == "save" and len(tokens) > 1:
            point, tokens = f"save:{tokens[1]}", tokens[2:]
        elif tokens[0] == "random":
            point, tokens = "random", tokens[1:]
        else:
            point = tokens[0]  # `step`: its value is read as the key `step`
        if point not in POINTS or len(tokens) % 2:
            raise FaultSpecError(f"{ENV} clause {text!r}: point must be one of {POINTS}, then "
                                 "KEY:VALUE pairs")
        keys = dict(zip(tokens[::2], tokens[1::2], strict=True))
        bad = set(keys) - set(KEYS)
        if bad:
            raise FaultSpecError(f"{ENV} clause {text!r}: unknown key(s) {sorted(bad)}; "
                                 f"use {KEYS}")
        clauses.append(Clause(action, point, keys))
    return clauses


def digest_steps() -> tuple[bool, set[int]]:
    """(digest wanted at all, steps after which to log it) from TRAINPLAN_DIGEST."""
    raw = os.environ.get(DIGEST_ENV, "").strip()
    steps = {int(s) for s in raw.split(",") if s.strip().isdigit()} if raw else set()
    return bool(raw) and raw != "0", steps


class Faults:
    """This process's injected faults. `log(event, **fields)` records one before it strikes."""

    def __init__(self, rank: int, world: int, log=None, spec: str | None = None):
        self.rank, self.world = rank, world
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.clauses = parse(os.environ.get(ENV, "") if spec is None else spec)
        self.log = log or (lambda event, **fields: None)
        self.step = 0  # the step under way, for the log of a random kill
        self._limit = None  # RLIMIT_FSIZE before a `full` fault, restored by `restore`
        self._timer_started = False

    def at(self, point: str, step: int) -> None:
        """Strike every clause that matches this point, step, rank and attempt."""
        if point == "step":
            self.step = step
            self._start_random()
        for c in self.clauses:
            if c.matches(point, step, self.rank, self.attempt):
                self._strike(c, point, step)

    def _strike(self, c: Clause, point: str, step: int) -> None:
        if c.action != "sleep":
            self.log("fault", action=c.action, point=point, step=step)
        if c.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif c.action == "hang":
            while not Signals.received:  # torchrun's SIGTERM (after the timeout) ends it
                time.sleep(0.05)
            os._exit(1)
        elif c.action == "oserror":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
        elif c.action == "full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us
            self._limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, self._limit[1]))
        elif c.action == "term":
            os.kill(os.getppid(), signal.SIGTERM)  # the torchrun agent, as a scheduler would
        elif c.action == "usr1":
            os.kill(os.getpid(), signal.SIGUSR1)
        elif c.action == "sleep":
            time.sleep(float(c.keys.get("s", 0)))

    def restore(self) -> None:
        """Lift a `full` fault's file-size limit once its save is over."""
        if self._limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self._limit)
            self._limit = None

    def _start_random(self) -> None:
        """Arm this attempt's random kill once, when training starts."""
        if self._timer_started:
            return
        self._timer_started = True
        for c in self.clauses:
            if c.point != "random" or self.attempt >= int(c.keys.get("max", 1)):
                continue
            rng = random.Random(int(c.keys.get("seed", 0)) * 1009 + self.attempt)
            delay = rng.expovariate(1.0 / float(c.keys.get("mtbf", 10)))
            victim = rng.randrange(self.world)
            if victim == self.rank:
                timer = threading.Timer(delay, self._random_kill, args=(delay,))
                timer.daemon = True
                timer.start()

    def _random_kill(self, delay: float) -> None:
        self.log("fault", action="kill", point="random", step=self.step, after_s=delay)
        os.kill(os.getpid(), signal.SIGKILL)


class Signals:
    """SIGTERM, SIGHUP and SIGUSR1 as a flag for the training loop (see the module docstring);
    SIGHUP (a closed terminal, a launcher's hangup passed on by torchrun) stops as SIGTERM."""

    received: list[int] = []  # signal numbers, in order; class-level so a hang can see them

    @classmethod
    def install(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, cls._handler)

    @classmethod
    def _handler(cls, signum, frame) -> None:
        cls.received.append(signum)

    @classmethod
    def pending(cls) -> int:
        """0 none, 1 SIGUSR1 (checkpoint, go on), 2 SIGTERM or SIGHUP (checkpoint, stop); clears
        the flag."""
        if not cls.received:
            return 0
        code = 2 if {signal.SIGTERM, signal.SIGHUP} & set(cls.received) else 1
        cls.received = []
        return code
