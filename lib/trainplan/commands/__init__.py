"""One module per group of verbs; `trainplan.cli` registers those named in `cli.VERB_MODULES`.

A verb module has `register(verbs)`, which adds its subparsers (built with
`commands.args.Parser`, so a bad flag is one line and exit 2) and sets two
defaults on each: `run(args) -> dict`, the library call, and
`fmt(out) -> str`, the human-readable form of that dict (`--json` prints the
dict itself). Import heavy modules inside `run`, after the arguments and
specs are checked, so that bad input is answered at once.
"""
