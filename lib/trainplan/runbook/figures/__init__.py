"""Figures and display tables of the runbook pages.

Selection, labelling and drawing only: every number drawn here comes from
the search table (`trainplan.plan.search`) or the specs, never from a formula in
this module. Figures carry no titles: the book captions them through
`{glue:figure}`. Each function returns a matplotlib Figure (or a DataFrame)
and leaves showing it to the notebook (`trainplan.runbook.pages.glue_figure`).

One module per runbook page group; the notebooks call them as `figures.NAME`.
"""

from trainplan.runbook.figures.launching import (  # noqa: F401
    watch_table,
)
from trainplan.runbook.figures.planning import (  # noqa: F401
    TOP_FAMILIES,
    alternatives,
    batch_table,
    candidates_tokens_per_s,
    comm_table,
    layout_name,
    layout_table,
    memory_breakdown,
    memory_table,
    recompute_microbatch,
    representatives,
    same_mesh,
    step_time_split,
    strategy_table,
    throughput_table,
    time_to_train_table,
    tradeoff_table,
)
from trainplan.runbook.figures.precision import (  # noqa: F401
    loss_parity,
    precision_bars,
    precision_table,
)
from trainplan.runbook.figures.resilience import (  # noqa: F401
    checkpoint_bench_figure,
    checkpoint_bench_table,
    checkpoint_cards,
    checkpoint_records,
    checkpoint_table,
    checkpoint_targets,
    checkpoint_targets_table,
    checkpoint_verdict,
    checkpoint_verdict_short,
    fault_matrix_caption,
    fault_matrix_table,
    lost_work_distribution,
    simulation_table,
)
from trainplan.runbook.figures.trace import (  # noqa: F401
    traced_split,
    traced_split_table,
)
from trainplan.runbook.figures.tuning import (  # noqa: F401
    paired_effects,
    skip_grid,
    suggest_table,
    tune_effects,
    tune_history,
    tune_importance,
)
from trainplan.runbook.figures.validation import (  # noqa: F401
    per_layer_table,
    predicted_vs_measured,
    validation_split,
    validation_table,
    weak_scaling_figure,
)
