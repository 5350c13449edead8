"""Batches for one optimizer step: synthetic (deterministic by global index) or the data module.

A step needs `grad_accum` micro-batches of (input_ids, labels), each
(micro_batch, seq_len), for this rank's data-parallel replica. Tensor-parallel
and pipeline ranks of one replica read the same data.

The synthetic source is built so that a layout and a single process see the
same global batch: step t's batch is one (dp * grad_accum * micro_batch, S+1)
block drawn from a generator seeded by (seed, t), and data-parallel rank r
takes rows of micro-batches r * grad_accum ... r * grad_accum + grad_accum - 1.
A single process with grad_accum' = dp * grad_accum reads the same rows, so
loss curves can be compared exactly. The sequences are arithmetic progressions
modulo the vocabulary (random start and stride) rather than uniform noise, so
the loss falls and a parity test compares a moving curve, not a flat ln V.

The harness's data flags (`add_arguments`) choose the source (`make_batches`): synthetic,
the packed stdlib text, or instruction records packed or padded (`--data instruct --pack
| --pad`), whose labels are -100 where there is no loss; `trained_share` is the share of
a step's label positions that carry loss (1 for the first two).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainplan.errors import LayoutError, TrainplanError

Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids, labels: (micro_batch, seq_len) each


class SyntheticBatches:
    """Deterministic learnable token sequences; see the module docstring."""

    def __init__(self, *, vocab: int, seq_len: int, micro_batch: int, grad_accum: int,
                 dp_rank: int, dp: int, seed: int, start: int = 0):
        self.vocab, self.seq_len, self.micro_batch = vocab, seq_len, micro_batch
        self.grad_accum, self.dp_rank, self.dp, self.seed = grad_accum, dp_rank, dp, seed
        self.start = start  # steps already consumed (a resumed run): its data position

    def step(self, t: int) -> list[Batch]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + t)
        rows = self.dp * self.grad_accum * self.micro_batch
        start = torch.randint(self.vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab  # (rows, S+1)
        out = []
        for a in range(self.grad_accum):
            first = (self.dp_rank * self.grad_accum + a) * self.micro_batch
            block = tokens[first:first + self.micro_batch]  # (mb, S+1)
            out.append((block[:, :-1].contiguous(), block[:, 1:].contiguous()))
        return out

    def __iter__(self) -> Iterator[list[Batch]]:
        t = self.start
        while True:
            yield self.step(t)
            t += 1


class LoaderBatches:
    """Groups of `grad_accum` micro-batches from `trainplan.bench.harness.data.build_loader`,
    cycled.

    `start` steps already consumed (a resumed run) are skipped: whole epochs by
    number, the rest of the current epoch by drawing and dropping its batches
    (the sampler's order is a function of seed and epoch, so this is the same
    stream for the same data-parallel size).
    """

    def __init__(self, grad_accum: int, start: int = 0, **loader_kwargs):
        try:
            from trainplan.bench.harness import data  # local: optional (--synthetic needs none)
        except ImportError as err:
            raise LayoutError(
                f"the data pipeline (trainplan.bench.harness.data) cannot be imported ({err}); "
                "use --synthetic"
            ) from None
        self.grad_accum, self.start = grad_accum, start
        self.loader = data.build_loader(**loader_kwargs)  # SpecError for bad knobs

    def __iter__(self) -> Iterator[list[Batch]]:
        from trainplan.bench.harness import data  # local: optional (--synthetic needs none)

        epoch, offset = divmod(self.start * self.grad_accum, len(self.loader))
        it = data.infinite(self.loader, epoch)  # epoch after epoch, reshuffled by set_epoch
        for _ in range(offset):
            next(it)
        while True:
            yield [next(it) for _ in range(self.grad_accum)]


def to_device(group: list[Batch], device: torch.device, non_blocking: bool) -> list[Batch]:
    return [(x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking))
            for x, y in group]


def trained_share(group: list[Batch]) -> float:
    """Share of a step's label positions with a loss (labels other than -100)."""
    return sum(int((y != -100).sum()) for _, y in group) / sum(y.numel() for _, y in group)


NUM_WORKERS = 2  # the loader's worker processes unless --num-workers says otherwise


def add_arguments(p) -> None:
    """The harness's data flags."""
    a = p.add_argument
    a("--synthetic", action="store_true", help="deterministic synthetic tokens, no data pipeline")
    a("--data", default="stdlib", choices=["stdlib", "instruct"],
      help="stdlib: the stdlib's source packed into rows (pretraining); instruct: prompt/"
           "response records, loss on the responses only (trainplan.data.rows)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--pack", dest="pack", action="store_const", const=True, default=None,
                   help="(--data instruct, the default) records packed into full rows, plain "
                        "causal attention across records")
    g.add_argument("--pad", dest="pack", action="store_const", const=False,
                   help="(--data instruct) one record a row, padded to --seq-len")
    a("--instruct-file", default=None, help="(--data instruct) JSON-lines records "
      '{"prompt", "response"}; default: made from the stdlib with --seed')
    a("--num-workers", type=int, default=NUM_WORKERS)
    a("--prefetch-factor", type=int, default=None)
    a("--pin-memory", action="store_true")


def check_args(args, *, synthetic_loader: bool = False) -> None:
    """One line for data flags that do not go together. `synthetic_loader`: the run feeds
    even synthetic tokens through a DataLoader (Trainer does), so its flags act there."""
    if args.prefetch_factor is not None and args.num_workers == 0:
        raise TrainplanError(f"--prefetch-factor {args.prefetch_factor} needs --num-workers >= "
                             "1 (the main process prefetches nothing); leave it out")
    if args.data != "instruct" and (args.pack is not None or args.instruct_file):
        raise TrainplanError("--pack, --pad and --instruct-file need --data instruct")
    if args.instruct_file:  # read here, so a bad file stops a run before the model is built
        from trainplan.data.instruct import read_records

        read_records(args.instruct_file)
    if args.data == "instruct" and args.synthetic:
        raise TrainplanError("--synthetic makes its own tokens; leave out --data instruct")
    if args.synthetic and not synthetic_loader:  # no DataLoader: its flags would not act
        for flag, value, default in (("--num-workers", args.num_workers, NUM_WORKERS),
                                     ("--prefetch-factor", args.prefetch_factor, None),
                                     ("--pin-memory", args.pin_memory, False)):
            if value != default:
                shown = flag if value is True else f"{flag} {value}"
                raise TrainplanError(f"{shown} has no effect with --synthetic (its tokens need "
                                     "no data loader); leave it out")
    if args.data == "instruct" and args.cp > 1:
        raise TrainplanError(f"--cp {args.cp}: context parallel is not wired for instruction "
                             "data (a rank's slice of a padded row may hold no loss)")


def make_batches(args, cfg, spec, dp_rank: int, dp: int, start: int = 0):
    """The step source the flags ask for, for data-parallel rank `dp_rank` of `dp`."""
    if args.synthetic:
        return SyntheticBatches(vocab=spec.vocab, seq_len=args.seq_len,
                                micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum,
                                dp_rank=dp_rank, dp=dp, seed=args.seed, start=start)
    return LoaderBatches(cfg.grad_accum, start=start, seq_len=args.seq_len,
                         micro_batch=cfg.micro_batch, rank=dp_rank, world=dp, seed=args.seed,
                         num_workers=args.num_workers, prefetch_factor=args.prefetch_factor,
                         pin_memory=args.pin_memory, vocab=spec.vocab, data=args.data,
                         pack=args.pack is not False, records=args.instruct_file)
