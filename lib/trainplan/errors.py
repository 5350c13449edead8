"""One exception hierarchy for everything a user can get wrong.

The CLI turns any `TrainplanError` into one line on stderr and exit code 2;
each message names the bad value and what would be valid, so the user can
fix it without reading code.
"""


MAX_LINE = 300  # characters of the one error line a command prints (`cli.one_line`)
ERROR_PREFIX = "trainplan: error: "  # how that line starts

class TrainplanError(Exception):
    """Base class: a problem with what the user asked for, not a bug."""


class SpecError(TrainplanError):
    """A model, GPU, cluster, layout or scenario spec is malformed or inconsistent."""


class PresetNotFound(SpecError):
    """A preset name that is neither in data/ nor a readable YAML file."""


class LayoutError(TrainplanError):
    """A parallel layout that cannot run (degrees that do not divide, batch not reachable)."""


class NoFeasiblePlan(TrainplanError):
    """The search found layouts, but none fits in memory."""


class RecordError(TrainplanError):
    """A measurement or prediction record file that does not follow the schema."""


class UsageError(TrainplanError):
    """Bad command-line arguments."""
