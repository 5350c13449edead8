"""`trainplan data prepare`: a team's text, JSON lines or parquet files into token shards;
`trainplan data instruct`: instruction records made from the Python stdlib, as JSON lines.

    trainplan data prepare CORPUS... --out DIR (--tokenizer tokenizer.json | --vocab-size N)
        [--val-fraction 0.01] [--text-field text] [--json]
    trainplan data instruct --out FILE.jsonl [--seed 0] [--limit N] [--json]

The shards' format is `trainplan.data.shards`'s docstring; the records' is
`trainplan.data.instruct`'s.
"""

from __future__ import annotations

import sys
import time

from trainplan.commands.args import Parser, fraction, non_negative_int, positive_int


def register(verbs) -> None:
    p = verbs.add_parser("data", help="prepare a corpus for training: token shards on disk")
    sub = p.add_subparsers(dest="data_verb", required=True, parser_class=Parser)
    q = sub.add_parser("prepare", help="text, JSONL or parquet files -> token shards")
    q.add_argument("corpus", nargs="+", help="files or folders (.txt, .md: a document a file, "
                   "of any size; .jsonl: one a line of at most 64 MiB; .parquet: one a row)")
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
    q = sub.add_parser("instruct", help="prompt/response records made from the Python stdlib")
    q.add_argument("--out", required=True, help="a new JSON-lines file")
    q.add_argument("--seed", type=non_negative_int, default=0, help="shuffle and phrasing")
    q.add_argument("--limit", type=positive_int, default=None, help="at most this many records")
    q.add_argument("--json", action="store_true", help="print a summary as one JSON object")
    q.set_defaults(run=cmd_instruct, fmt=format_instruct)


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


def cmd_instruct(args) -> dict:
    import numpy as np  # numpy: not loaded for --help

    from trainplan.data import instruct

    instruct.check_out(args.out)  # before the records are made (seconds)
    records = instruct.stdlib_records(args.seed, args.limit)
    instruct.write_records(records, args.out)
    chars = {f: np.percentile([len(r[f]) for r in records], [10, 50, 90, 99]).round().tolist()
             for f in instruct.FIELDS}
    return {"out": args.out, "records": len(records), "seed": args.seed,
            "chars_p10_p50_p90_p99": chars}


def format_instruct(out: dict) -> str:
    p, r = out["chars_p10_p50_p90_p99"]["prompt"], out["chars_p10_p50_p90_p99"]["response"]
    return (f"{out['out']}: {out['records']:,} records (seed {out['seed']}); characters "
            f"p10/p50/p90/p99: prompts {'/'.join(f'{v:,.0f}' for v in p)}, responses "
            f"{'/'.join(f'{v:,.0f}' for v in r)}")
