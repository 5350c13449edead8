"""Page 6's commands, as written (`runbook.quickstart`), on a tiny model and two CPU ranks.

`trainplan data prepare` (a BPE trained by `tokenizers` on stdlib text), `trainplan launch`
(here with the layout pinned, no scenario: a scenario's 32 GPUs do not fit this machine),
the generated torchrun script run as a node runs it, then `trainplan export` and
`transformers` reading the export.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.launch.helpers import run_env
from tests.launch.slurm_cluster import free_port

from trainplan.runbook.quickstart import Quickstart

TINY = "name: tiny-qs\nn_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 512\n"
PINNED = ("--gpu", "h100-sxm", "--gpus", "2", "--gpus-per-node", "2", "--dp", "2", "--tp", "1",
          "--pp", "1", "--zero", "3", "--micro-batch", "2", "--grad-accum", "1", "--recompute",
          "none", "--seq-len", "32", "--global-batch-tokens", "128", "--cpu", "--steps", "6",
          "--ckpt-every", "3", "--train-arg", "lr=3e-3")


def run(cmd: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "trainplan.cli", *cmd[1:]] if cmd[0] == "trainplan" else cmd
    return subprocess.run(argv, cwd=cwd, env=run_env(**env), capture_output=True, text=True,
                          timeout=300)


def test_three_commands_then_export(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]):
        (corpus / f"{i:03d}.txt").write_text(path.read_text(errors="replace"))
    (tmp_path / "tiny.yaml").write_text(TINY)
    qs = Quickstart(corpus="corpus", vocab_size=512, model="tiny.yaml", scenario="",
                    target="torchrun", launch_extra=PINNED)
    prepare, launch, start = qs.commands()
    for cmd in (prepare, launch):
        proc = run(cmd, tmp_path)
        assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "job" / "torchrun.sh").read_text()
    assert "-m trainplan.train" in script and '--data "$DATA_DIR"' in script
    proc = run(start, tmp_path, RDZV_HOST="127.0.0.1", RDZV_PORT=str(free_port()),
               NODE_NAME="node0")
    log = next((tmp_path / "logs").rglob("node0.log")).read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "step 6/6 | loss" in log
    ckpts = tmp_path / "checkpoints"
    (run_dir,) = [p for p in ckpts.iterdir() if p.is_dir()]
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-000003", "step-000006"]
    assert (next((tmp_path / "logs").rglob("training.jsonl"))).is_file()

    proc = run(qs.export(str(run_dir), out="hf"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.num_hidden_layers == 2 and hf.config.vocab_size == 512
    with torch.no_grad():
        logits = hf(input_ids=torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all()


def test_readme_and_page_six_show_the_same_commands():
    """The README's quick start is `runbook.quickstart`'s default, line for line."""
    from trainplan.runbook.quickstart import shell

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for cmd in Quickstart().commands():
        assert shell(cmd) in readme.splitlines(), shell(cmd)
