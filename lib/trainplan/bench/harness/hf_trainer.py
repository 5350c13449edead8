"""The outside rival: transformers' own `Trainer` (with accelerate), configured at its best.

`hf_baseline` runs LlamaForCausalLM inside the harness's loop, layout code, loss and
optimizer: a control that isolates the model code (the two run the same kernels). This
module runs what a team would run instead of trainplan: the same model (`hf_baseline.
hf_config`, the harness's initialisation) trained by `transformers.Trainer` on the same
rows of the same data (`data.build_dataset`), with what Trainer offers for speed:

- bf16 mixed precision (`bf16=True`: autocast, fp32 master weights), Trainer's default
  optimizer on torch >= 2.8 (fused AdamW) with the harness's betas (0.9, 0.95), weight
  decay 0.1, clipping at `--max-norm` and a constant learning rate;
- `torch_compile=True` where the config compiles, by accelerate's regional compilation (the
  decoder layers and the other top modules apart, as the harness compiles) unless its switch
  `ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION` says otherwise: a whole-model compile makes
  transformers hand SDPA a materialised causal mask, a step 18% slower on an H200
  (data/measurements/sidebyside-h200x1-20261129b/); SDPA attention, no KV cache;
- DDP for zero 0; accelerate's FSDP2 for ZeRO-2 (`reshard_after_forward=False`) and ZeRO-3,
  wrapping each decoder layer; `gradient_checkpointing` for recompute full (Trainer has no
  selective recompute);
- the harness's loader flags (workers, prefetch, pinned memory); no logging, saving or
  evaluation during the timed steps.

Timing (`StepClock`): the device is synchronised at the end of each optimizer step; a step
is the time from the end of the previous one (the first: from the start of training), so
the data, clipping and Trainer's own bookkeeping are inside it, as they are inside the
harness's step; the loss is read after the clock stops, as the harness reads its own.
The summary and record are the harness's (`train.summarise`, `impl: "hf-trainer"`).

`torchrun ... -m trainplan.bench.harness.hf_trainer <train.py's flags but --impl>`; a
suite config's `impl: hf-trainer`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from importlib.metadata import version
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from trainplan.bench.harness import hf_baseline, host
from trainplan.bench.harness import train as harness
from trainplan.bench.harness.model import count_params
from trainplan.errors import LayoutError, TrainplanError

IMPL = "hf-trainer"
REGIONAL = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"  # accelerate's switch, read at Trainer()
ZERO = (0, 2, 3)  # DDP, FSDP2 without and with resharding after forward


class Rows(Dataset):
    """The harness's (inputs, labels) rows as Trainer's {"input_ids", "labels"} items.

    The harness's labels are already the next tokens; Trainer's loss shifts `labels` by
    one itself, so position t's label goes to t + 1 (-100 at 0): the same targets, the
    last one dropped, -100 kept where labels are masked.
    """

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.base[i]
        labels = torch.cat([torch.full((1,), -100, dtype=y.dtype), y[:-1]])
        return {"input_ids": x, "labels": labels}


def check(args, spec, cfg, world: int) -> None:
    """Refuse (one line) what this baseline does not run, naming the value."""
    hf_baseline.check(spec, cfg)  # a dense untied Llama; data-parallel layouts only
    if cfg.zero not in ZERO:
        raise LayoutError(f"--impl {IMPL} with --zero {cfg.zero}: accelerate's FSDP2 has no "
                          "ZeRO-1; use --zero 0 (DDP), 2 or 3")
    if cfg.zero and cfg.dp_shard < cfg.dp:
        raise LayoutError(f"--impl {IMPL} with --dp-shard {cfg.dp_shard} < --dp {cfg.dp}: HSDP "
                          "is not wired for Trainer here; leave --dp-shard out")
    if cfg.recompute == "selective":
        raise LayoutError(f"--impl {IMPL} with --recompute selective: Trainer checkpoints "
                          "whole layers only; use --recompute none or full")
    if cfg.dp != world:
        raise LayoutError(f"--dp {cfg.dp} with {world} processes: this baseline is data "
                          f"parallel only; launch --dp processes")
    if cfg.dp > 1 and cfg.zero and (args.cpu or not torch.cuda.is_available()):
        raise LayoutError(f"--impl {IMPL} with --zero {cfg.zero} on CPU: accelerate shards "
                          "with FSDP on GPUs only (on CPU it runs DDP); use --zero 0 on CPU")
    if args.data != "stdlib":
        raise TrainplanError(f"--data {args.data} with --impl {IMPL}: the baseline's record "
                             "cannot count which tokens carry loss; use --data stdlib")
    if args.ckpt_dir:
        raise TrainplanError(f"--ckpt-dir with --impl {IMPL}: the baseline is timed without "
                             "checkpoints; leave --ckpt-dir out")


def build_model(spec, seq_len: int, seed: int):
    """LlamaForCausalLM of `spec` from the seed, initialised as the harness's model."""
    tf = hf_baseline.require_transformers()
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(hf_baseline.hf_config(spec, seq_len))
    hf_baseline.init_like_ours(model, spec)
    return model


def trainer_arguments(args, cfg, out_dir: str, cuda: bool) -> dict:
    """TrainingArguments for the config: the best Trainer offers at this layout (docstring)."""
    kw = dict(output_dir=out_dir, per_device_train_batch_size=cfg.micro_batch,
              gradient_accumulation_steps=cfg.grad_accum, max_steps=args.steps,
              learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1,
              max_grad_norm=args.max_norm, lr_scheduler_type="constant", warmup_steps=0,
              bf16=cuda, use_cpu=not cuda, torch_compile=bool(args.compile),
              gradient_checkpointing=cfg.recompute == "full",
              dataloader_num_workers=args.num_workers, dataloader_pin_memory=args.pin_memory,
              dataloader_prefetch_factor=args.prefetch_factor,
              dataloader_persistent_workers=args.num_workers > 0, dataloader_drop_last=True,
              logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
              disable_tqdm=True, seed=args.seed, data_seed=args.seed)
    if cfg.dp > 1 and cfg.zero > 0:
        kw.update(fsdp=True, fsdp_config={
            "version": 2, "reshard_after_forward": cfg.zero == 3,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    elif cfg.dp > 1:
        kw.update(ddp_find_unused_parameters=False)
    return kw


def compile_scope(model) -> str:
    """What torch.compile wrapped in the model Trainer trained: "whole model" (the model is
    one compiled module), "regions" (compiled submodules under an eager top) or "none".
    Compiled is either wrapped (`torch.compile(m)`) or compiled in place (`m.compile()`, as
    accelerate compiles FSDP2's regions: the module keeps its class)."""
    from torch._dynamo.eval_frame import OptimizedModule

    def compiled(m) -> bool:
        return isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None

    if compiled(model):
        return "whole model"
    return "regions" if any(compiled(m) for m in model.modules()) else "none"


def step_clock(device, holder: dict):
    """A TrainerCallback timing whole optimizer steps (module docstring) and reading the loss.

    `holder["trainer"]` is set to the Trainer once built: its on-device running loss sum
    is read after each step's clock stops (Trainer's own accounting of the loss)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.losses, self.seen = [], [], 0.0
            self.last = self.started = None  # perf_counter at the start of training

        def on_train_begin(self, args, state, control, **kw):
            harness.sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            self.last = self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            harness.sync(device)
            self.times.append(time.perf_counter() - self.last)
            running = getattr(holder.get("trainer"), "_tr_loss", None)
            if isinstance(running, torch.Tensor):
                total = float(running.detach().float().sum())
                self.losses.append(total - self.seen)
                self.seen = total
            self.last = time.perf_counter()

    return StepClock()


def on_step_end(fn):
    """A TrainerCallback calling `fn()` at the end of every optimizer step (after the clock's
    callback): how `observe.profile` steps its profiler's schedule on a Trainer run."""
    from transformers import TrainerCallback

    class Each(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            fn()

    return Each()


def run(args, callbacks=()) -> dict:
    """Train `--steps` optimizer steps under Trainer and return the harness's summary;
    `callbacks` (TrainerCallbacks) run after the step clock's (a profiler's, say)."""
    began = time.perf_counter()  # setup_s: model, Trainer, wrappers, up to the first step
    args.impl = IMPL
    harness.check_args(args)
    host.allocator_env(os.environ)  # the harness's allocator, before CUDA starts
    tf = hf_baseline.require_transformers()
    spec, cfg = harness.load_spec(args), harness.layout(args)
    world = int(os.environ.get("WORLD_SIZE", 1))
    check(args, spec, cfg, world)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    from trainplan.bench.harness import data

    rows = Rows(data.build_dataset(seq_len=args.seq_len, vocab=spec.vocab, seed=args.seed,
                                   synthetic=args.synthetic))  # the stdlib corpus (check)
    model = build_model(spec, args.seq_len, args.seed)
    holder: dict = {}
    clock = step_clock(device, holder)
    if args.compile:
        os.environ.setdefault(REGIONAL, "1")  # the faster of accelerate's two (docstring)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as out_dir:
        targs = tf.TrainingArguments(**trainer_arguments(args, cfg, out_dir, cuda))
        trainer = tf.Trainer(model=model, args=targs, train_dataset=rows,
                             callbacks=[clock, *callbacks])
        trainer.remove_callback(tf.trainer_callback.PrinterCallback)  # stdout: our JSON only
        holder["trainer"] = trainer
        trainer.train()
        wrapped = type(trainer.model_wrapped).__name__  # DistributedDataParallel, FSDP...
        compiled = compile_scope(trainer.model_wrapped)
        if bool(args.compile) != (compiled != "none"):
            raise TrainplanError(f"Trainer compiled {compiled} for --compile "
                                 f"{bool(args.compile)}; the record would say otherwise")
        if (cfg.dp > 1 and cfg.zero > 0) != trainer.is_fsdp_enabled:
            raise TrainplanError(f"Trainer ran {trainer.accelerator.distributed_type} for "
                                 f"--zero {cfg.zero} (FSDP {trainer.is_fsdp_enabled}); the "
                                 "record would name the wrong layout")
    notes = [f"{IMPL}: transformers {tf.__version__} Trainer, accelerate "
             f"{version('accelerate')}, LlamaForCausalLM, sdpa, use_cache=False, optim "
             f"{getattr(targs.optim, 'value', targs.optim)}", f"{count_params(model)} parameters",
             f"wrapped as {wrapped}", f"compiled: {compiled}",
             "losses: Trainer's running loss per step"]
    summary = harness.summarise(args, spec, cfg, device, world, clock.times, clock.losses,
                                SimpleNamespace(notes=notes))  # summarise reads .notes
    summary["grad_norms"] = []  # Trainer clips but does not hand its norm to a callback
    summary["setup_s"] = round(clock.started - began, 3)  # the first step holds the compile
    return summary


def main(argv=None, callbacks=()) -> int:
    """The harness's command line (train.py's flags) for this baseline: one JSON line."""
    args = harness.parse_args(argv)
    try:
        if args.impl != "trainplan":  # train.py's default: the flag was given
            raise TrainplanError(f"--impl {args.impl}: this module trains with transformers' "
                                 f"Trainer ({IMPL}); leave --impl out")
        summary = run(args, callbacks)
        if not dist.is_initialized() or dist.get_rank() == 0:
            if args.records:
                harness.write_record(args.records, summary, args.run_id)
            print(json.dumps(summary))
    except TrainplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
