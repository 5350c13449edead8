"""The record files the committed calibrations were fitted on, as paths from the repository
root, one a line: what `make snap` adds to a device call's snapshot so that `trainplan
calibrate --committed --host-records host.jsonl` runs there. A listed file the repository
does not hold (a calibration written before sources were named from data/measurements) is
left out; `calibrate --committed` then says which one it misses.

    .venv/bin/python tools/calibration_sources.py
"""

from __future__ import annotations

from trainplan.calibrate.store import CALIBRATION_DIR, RECORDS_DIR, load
from trainplan.specs import DATA_DIR


def main() -> None:
    root = DATA_DIR.parent
    for path in sorted(CALIBRATION_DIR.glob("*.yaml")):
        for src in (load(path.stem) or {}).get("sources") or ():
            file = RECORDS_DIR / src["path"]
            if file.is_file():
                print(file.relative_to(root))


if __name__ == "__main__":
    main()
