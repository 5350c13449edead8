"""The commands from a folder of text to a running job, and on to `transformers`.

One source for page 6, the README's quick start and the test that runs them as written
(tests/train/test_quickstart.py, on a tiny model and CPU ranks): prepare the team's text
into token shards with its tokenizer, write the job's scripts from the plan of a scenario
(the layout of page 1, the checkpoints of page 5), start it. A restart runs the same start
command (the scripts pass --resume); the export turns the newest checkpoint into a folder
that `transformers.LlamaForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from trainplan.loader import json_lines


@dataclass(frozen=True)
class Quickstart:
    """Names of the team's inputs and outputs, and the launch's target."""

    corpus: str = "corpus/"  # the team's text: .txt, .md, .jsonl or .parquet files
    tokenizer: str = "tokenizer.json"  # the model's tokenizer (tokenizers' format)
    model: str = "config.json"  # the model's Hugging Face config
    scenario: str = "llama-13b-32xh100"  # the cluster and token budget to plan for
    shards: str = "shards"
    job: str = "job"
    target: str = "slurm"  # slurm | torchrun | k8s
    vocab_size: int = 0  # train a tokenizer of this many ids instead of `tokenizer`
    launch_extra: tuple = field(default_factory=tuple)  # more `trainplan launch` flags

    def prepare(self) -> list[str]:
        tok = (["--vocab-size", str(self.vocab_size)] if self.vocab_size
               else ["--tokenizer", self.tokenizer])
        return ["trainplan", "data", "prepare", self.corpus, *tok, "--out", self.shards]

    def launch(self) -> list[str]:
        scenario = ["--scenario", self.scenario] if self.scenario else []
        return ["trainplan", "launch", *scenario, "--model", self.model, "--data",
                self.shards, "--target", self.target, "--out", self.job, *self.launch_extra]

    def start(self) -> list[str]:
        return {"slurm": ["sbatch", f"{self.job}/train.sbatch"],
                "torchrun": [f"{self.job}/torchrun.sh"],
                "k8s": ["kubectl", "apply", "-f", f"{self.job}/pytorchjob.yaml"]}[self.target]

    def export(self, checkpoints: str, out: str = "hf") -> list[str]:
        return ["trainplan", "export", "--ckpt", checkpoints, "--model", self.model, "--out",
                out]

    def commands(self) -> list[list[str]]:
        """The three commands, in order."""
        return [self.prepare(), self.launch(), self.start()]


def shell(cmd: list[str]) -> str:
    """One command as a shell line."""
    return " ".join(shlex.quote(a) for a in cmd)


def real_data_note(root: Path | None = None) -> str:
    """Page 6's sentence on the trainer's measured throughput on real data, from the newest
    committed `data/measurements/real-vs-proxy-*` record (`tools/real_vs_proxy.sh`): the
    trainer's median tokens/s/GPU after warm-up over the proxy harness's, same layout and
    host; or that no such record exists (markdown)."""
    root = root or Path(__file__).resolve().parents[3]
    runs = sorted((root / "data" / "measurements").glob("real-vs-proxy-*"))
    if not runs:
        return "The trainer's throughput on real data has not been measured on GPUs yet."
    run = runs[-1]
    proxy = json_lines(run / "proxy.jsonl")[-1][1]
    warm = proxy["warmup_steps_dropped"]
    steps = [r for _, r in json_lines(run / "train-log" / "training.jsonl")]
    real = statistics.median(r["tokens_per_s_per_gpu"] for r in steps
                           if "tokens_per_s_per_gpu" in r and r["step"] > warm)
    return (f"On {proxy['gpus']} x {proxy['card'].replace('NVIDIA ', '')}, the trainer on real "
            f"shards ran at {real / proxy['tokens_per_s_per_gpu']:.2f} times the proxy's speed "
            f"(`data/measurements/{run.name}/`).")
