"""Run `trainplan.cli.main` many times fast, each run in its own forked process, bounded.

A helper process for the hostile-input tests: it imports trainplan and the libraries
its verbs load (pandas, optuna, torch) once, then reads one JSON request a line on stdin,
{"argv": [...], "cwd": DIR, "timeout_s": 10}, forks a child that runs the CLI with stdin
from /dev/null, stdout and stderr to files, an address-space limit and two clocks: SIGPROF
after `timeout_s` seconds of CPU, SIGALRM after `HANG` times that of wall time (a run that
waits on nothing). It answers one JSON line: {"rc", "stdout", "stderr", "seconds",
"cpu_seconds", "rss_growth_mib"}. `rc` is the exit code, or -N for a child killed by
signal N. `rss_growth_mib` is the child's peak resident set less the helper's at the fork.
CPU time, not wall time, is the budget: on a loaded machine a run's wall time says more
about its neighbours than about it.

One process of our own (no test runner threads in it) forks: what a user's one-off
`trainplan ...` costs is the child's time and memory, without the imports.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback

HEADROOM = 2 * 2**30  # address space a child may add: a hard stop well past the 1 GiB asked
HANG = 6  # wall-time limit, as a multiple of the CPU-time one


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _child(argv: list[str], cwd: str, timeout_s: float) -> None:
    from trainplan import cli

    rc = 1
    try:
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, ".stdout"), (2, ".stderr")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        limit = _vm_kib("VmSize") * 1024 + HEADROOM
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        for sig in (signal.SIGALRM, signal.SIGPROF):
            signal.signal(sig, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_PROF, timeout_s)
        signal.setitimer(signal.ITIMER_REAL, HANG * timeout_s)
        rc = cli.main(argv)
    except SystemExit as err:  # argparse's --help and --version
        rc = err.code if isinstance(err.code, int) else 1
    except BaseException:  # a traceback is what the tests look for: print it as Python would
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def run_one(req: dict) -> dict:
    rss = _vm_kib("VmRSS")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(req["argv"], req["cwd"], float(req.get("timeout_s", 10)))
    _, status, usage = os.wait4(pid, 0)
    seconds = time.monotonic() - t0
    rc = os.waitstatus_to_exitcode(status)
    out = {"rc": rc, "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
           "rss_growth_mib": max(0, usage.ru_maxrss - rss) / 1024}
    for key, name in (("stdout", ".stdout"), ("stderr", ".stderr")):
        path = os.path.join(req["cwd"], name)
        with open(path, "rb") as f:
            out[key] = f.read(1 << 20).decode("utf-8", "replace")
        os.unlink(path)
    return out


# What the verbs import when they run (not for --help): imported once, before any fork.
LAZY = ("torch", "trainplan.bench.harness.train", "trainplan.bench.harness.hf_baseline",
        "trainplan.bench.series.run", "trainplan.bench.series.sidebyside",
        "trainplan.calibrate.fit", "trainplan.compare.accuracy", "trainplan.compare.trust",
        "trainplan.data.shards", "trainplan.launch.job", "trainplan.plan.planner",
        "trainplan.train.batches", "trainplan.train.export", "trainplan.train.loop",
        "trainplan.train.support", "trainplan.tune.loop", "trainplan.tune.report",
        "trainplan.tune.suggest", "trainplan.validate")


def main() -> None:
    import importlib

    import trainplan.cli

    for name in LAZY:
        importlib.import_module(name)
    trainplan.cli.build_parser()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run_one(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
