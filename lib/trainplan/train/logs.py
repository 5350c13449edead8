"""What a training run tells its people: a progress line, JSON lines, TensorBoard events.

Rank 0 writes, every `every` steps and at every evaluation:
- stderr: `step 120/1000 | loss 3.2109 | lr 2.95e-04 | 61,234 tok/s/GPU | MFU 48.1% | ETA 14m05s`
- `<log_dir>/training.jsonl`: one object per logged step ({"step", "loss", "lr", "grad_norm",
  "tokens", "tokens_per_s_per_gpu", "mfu", "elapsed_s"}) or evaluation ({"step",
  "eval_loss", "eval_tokens"}), appended and flushed, so a resumed run continues the file;
- `<log_dir>/tb/`: the same scalars as TensorBoard events (`torch.utils.tensorboard`).
Rates are over the steps since the previous line, so the compile of the first step shows
in the first line only; MFU is tokens/s/GPU x FLOPs per token (6N + 12 l h s) / peak.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def eta(seconds: float) -> str:
    """'1h02m', '14m05s' or '9s'."""
    s = int(max(0, seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class RunLog:
    """The run's progress line, metrics.jsonl and TensorBoard writer (rank 0 only)."""

    def __init__(self, log_dir: str | None, *, total_steps: int, tokens_per_step: int,
                 world: int, flops_per_token: float, peak_flops: float | None,
                 every: int, enabled: bool, progress: bool = True):
        self.total, self.tokens_per_step, self.world = total_steps, tokens_per_step, world
        self.flops_per_token, self.peak, self.every = flops_per_token, peak_flops, every
        self.enabled, self.progress = enabled, progress and enabled
        self.jsonl = self.tb = None
        self.began = self.mark = time.perf_counter()
        self.mark_step = None
        if enabled and log_dir:
            folder = Path(log_dir)
            folder.mkdir(parents=True, exist_ok=True)
            self.jsonl = (folder / "training.jsonl").open("a", encoding="utf-8")
            from torch.utils.tensorboard import SummaryWriter  # tensorboard: only when logging

            self.tb = SummaryWriter(str(folder / "tb"))

    def start(self, step: int) -> None:
        """The run begins (or resumes) after optimizer step `step`."""
        self.mark, self.mark_step = time.perf_counter(), step

    def step(self, step: int, loss: float, lr: float, grad_norm: float) -> dict | None:
        """After optimizer step `step` (1-based): a line every `every` steps and at the end."""
        if not self.enabled or (step % self.every and step != self.total):
            return None
        now = time.perf_counter()
        steps = step - self.mark_step
        rate = steps * self.tokens_per_step / max(now - self.mark, 1e-9) / self.world
        mfu = rate * self.flops_per_token / self.peak if self.peak else None
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens": step * self.tokens_per_step, "tokens_per_s_per_gpu": rate,
               "mfu": mfu, "elapsed_s": now - self.began}
        self.mark, self.mark_step = now, step
        if self.progress:
            left = (self.total - step) * self.tokens_per_step / max(rate * self.world, 1e-9)
            mfu_text = f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""
            print(f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
                  f"{rate:,.0f} tok/s/GPU{mfu_text} | ETA {eta(left)}", file=sys.stderr,
                  flush=True)
        self._write(row, step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                                "train/tokens_per_s_per_gpu": rate})
        return row

    def evaluation(self, step: int, loss: float, tokens: int) -> None:
        if not self.enabled:
            return
        if self.progress:
            print(f"step {step}/{self.total} | eval loss {loss:.4f} over {tokens:,} tokens",
                  file=sys.stderr, flush=True)
        self._write({"step": step, "eval_loss": loss, "eval_tokens": tokens}, step,
                    {"eval/loss": loss})
        self.mark = time.perf_counter()  # evaluation time is not training time

    def _write(self, row: dict, step: int, scalars: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
