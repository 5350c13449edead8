"""`trainplan VERB ...`: a thin command line over the library.

Parses, delegates, prints. Every `TrainplanError` (and every argument error)
becomes one line on stderr (at most `MAX_LINE` characters) and exit code 2;
`--json` prints one JSON object on stdout, notes go to stderr. The verbs live
in `trainplan.commands`, one module per group; the contract is in the README
("Command line").
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings

from trainplan import __version__
from trainplan.commands.args import Parser
from trainplan.errors import ERROR_PREFIX, MAX_LINE, TrainplanError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # what a shell reports for a program ended by SIGINT
VERB_MODULES = ("planning", "validation", "resilience", "tuning", "launching", "benchmarking",
                "data", "training")


def build_parser() -> Parser:
    parser = Parser(prog="trainplan", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"trainplan {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for name in VERB_MODULES:
        importlib.import_module(f"trainplan.commands.{name}").register(verbs)
    return parser


def one_line(err: Exception, limit: int = MAX_LINE) -> str:
    """The message of `err` as the one stderr line, at most `limit` characters: a longer one
    keeps its start (the bad value) and its end (what is valid), the middle elided."""
    line = f"{ERROR_PREFIX}{' '.join(str(err).split())}"
    if len(line) <= limit:
        return line
    head = (limit - 5) * 2 // 3
    return f"{line[:head]} ... {line[len(line) - (limit - 5 - head):]}"


def main(argv: list[str] | None = None) -> int:
    """Run one verb. Its notes (choices made for the user) go to stderr once it succeeded;
    on an error the one line is all stderr gets, warnings raised on the way included."""
    with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
        try:
            args = build_parser().parse_args(argv)
            args.notes = []
            out = args.run(args)
        except TrainplanError as err:
            print(one_line(err), file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:  # Ctrl-C: the verb has cleaned up what it had begun
            print("trainplan: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for note in args.notes:
        print(f"trainplan: {note}", file=sys.stderr)
    print(json.dumps(out) if getattr(args, "json", False) else args.fmt(out))
    return out.get("exit_code", 0) if isinstance(out, dict) else 0  # a stopped run: not 0


if __name__ == "__main__":
    sys.exit(main())
