"""Tables of page 6: launch and operations."""

from __future__ import annotations

import pandas as pd


def watch_table(w: dict) -> pd.DataFrame:
    """What a healthy run shows and where the alert lines are, from
    `trainplan.launch.artefacts.watch`."""
    rows = [
        ("tokens/s per GPU (plan)", f"{w['tokens_per_s_per_gpu']:,.0f}"),
        ("tokens/s, whole job (plan)", f"{w['tokens_per_s']:,.0f}"),
        ("step time (plan, s)", f"{w['step_time_s']:.2f}"),
        ("MFU (plan)", f"{w['mfu']:.1%}"),
        ("memory per GPU (plan, GiB)", f"{w['memory_gib']:.1f}"),
        ("alert: tokens/s per GPU below", f"{w['alert_tokens_per_s_per_gpu']:,.0f}"),
        ("straggler: a rank's step time above (s)", f"{w['straggler_step_time_s']:.2f}"),
        ("checkpoint every (steps)", f"{w['checkpoint_every_steps']:,}"),
        ("checkpoint every (minutes)", f"{w['checkpoint_every_min']:.0f}"),
        ("collective timeout (minutes)", f"{w['collective_timeout_min']:.0f}"),
    ]
    return pd.DataFrame({"value": [v for _, v in rows]}, index=[k for k, _ in rows])
