"""`trainplan VERB ...`: a thin command line over the library.

Parses, delegates, prints. Every `TrainplanError` (and every argument error)
becomes one line on stderr and exit code 2; `--json` prints one JSON object on
stdout. The verbs live in `trainplan.commands`, one module per group; the
contract is in the README ("Command line").
"""

from __future__ import annotations

import importlib
import json
import sys

from trainplan import __version__
from trainplan.commands.args import Parser
from trainplan.errors import TrainplanError

EXIT_USAGE = 2
VERB_MODULES = ("planning", "validation", "resilience", "tuning", "launching", "benchmarking",
                "data", "training")


def build_parser() -> Parser:
    parser = Parser(prog="trainplan", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"trainplan {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for name in VERB_MODULES:
        importlib.import_module(f"trainplan.commands.{name}").register(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        out = args.run(args)
    except TrainplanError as err:
        print(f"trainplan: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(out) if getattr(args, "json", False) else args.fmt(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
