"""The record files the committed calibrations were fitted on, as paths from the repository
root, one a line: what `make snap` adds to a device call's snapshot so that `trainplan
calibrate --committed --host-records host.jsonl` runs there. A listed file the repository
does not hold (a calibration written before sources were named from data/measurements) is
left out; `calibrate --committed` then says which one it misses.

    .venv/bin/python tools/calibration_sources.py
"""

from __future__ import annotations

from trainplan.calibrate.store import CALIBRATION_DIR, listed_sources
from trainplan.specs import DATA_DIR


def main() -> None:
    for cal in sorted(CALIBRATION_DIR.glob("*.yaml")):
        for _, path in listed_sources(cal.stem):
            if path.is_file():
                print(path.relative_to(DATA_DIR.parent))


if __name__ == "__main__":
    main()
