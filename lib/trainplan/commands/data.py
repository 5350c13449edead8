"""`trainplan data prepare`: a team's text, JSON lines or parquet files into token shards.

    trainplan data prepare CORPUS... --out DIR (--tokenizer tokenizer.json | --vocab-size N)
        [--val-fraction 0.01] [--text-field text] [--json]

The shards' format is `trainplan.data.shards`'s docstring.
"""

from __future__ import annotations

import sys
import time

from trainplan.commands.args import Parser, fraction, positive_int


def register(verbs) -> None:
    p = verbs.add_parser("data", help="prepare a corpus for training: token shards on disk")
    sub = p.add_subparsers(dest="data_verb", required=True, parser_class=Parser)
    q = sub.add_parser("prepare", help="text, JSONL or parquet files -> token shards")
    q.add_argument("corpus", nargs="+", help="files or folders (.txt, .md, .jsonl, .parquet)")
    q.add_argument("--out", required=True, help="a new folder for the shards")
    q.add_argument("--tokenizer", default=None, help="the model's tokenizer.json")
    q.add_argument("--vocab-size", type=positive_int, default=None,
                   help="train a byte-level BPE of this many ids on the corpus instead")
    q.add_argument("--val-fraction", type=fraction, default=0.01,
                   help="share of documents held out for evaluation")
    q.add_argument("--text-field", default="text", help="JSONL key / parquet column of the text")
    q.add_argument("--json", action="store_true", help="print the index as one JSON object")
    q.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    q.set_defaults(run=cmd_prepare, fmt=format_prepare)


def cmd_prepare(args) -> dict:
    from trainplan.data.shards import prepare  # numpy: not loaded for --help

    t0 = time.monotonic()

    def progress(docs: int, tokens: int) -> None:
        rate = tokens / max(time.monotonic() - t0, 1e-9)
        print(f"\rprepare: {docs:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)",
              end="", file=sys.stderr, flush=True)

    index = prepare(args.corpus, args.out, tokenizer=args.tokenizer,
                    vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                    text_field=args.text_field, progress=None if args.no_progress else progress)
    if not args.no_progress:
        print(file=sys.stderr)
    return {"out": args.out, **index}


def format_prepare(out: dict) -> str:
    tr, va = out["splits"]["train"], out["splits"]["val"]
    return (f"{out['out']}: {tr['tokens']:,} training tokens in {tr['documents']:,} documents "
            f"({len(tr['shards'])} shards), {va['tokens']:,} held-out tokens in "
            f"{va['documents']:,} documents; vocabulary {out['vocab_size']:,} ({out['dtype']}), "
            f"end of document id {out['eos_id']}")
