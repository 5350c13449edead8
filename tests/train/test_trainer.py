"""`trainplan train` end to end on CPU: real torchrun (gloo, 2 ranks), FSDP2, DCP checkpoints,
shards prepared by `trainplan data prepare` with a BPE that `tokenizers` trains in the test,
and the export read back by `transformers`.

The corpus is the Python standard library's own text (every machine has it); the model is a
tiny Llama of the Hugging Face family (GQA, rope theta and norm epsilon not the defaults).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from trainplan import cli

LIB = Path(__file__).resolve().parents[2] / "lib"
TINY = ("name: tiny-train\nn_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\n"
        "vocab: 512\nrope_theta: 500000\nnorm_eps: 1.0e-6\n")
RUN = ["--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--dp", "2", "--zero",
       "3", "--lr", "3e-3", "--lr-warmup", "2", "--eval-every", "6", "--eval-batches", "2",
       "--log-every", "3", "--cpu", "--json"]
STEPS, EVERY = 12, 4


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A corpus of stdlib modules as text files, its shards (BPE of 512 ids), the model YAML."""
    base = tmp_path_factory.mktemp("train")
    corpus = base / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, path in enumerate(sorted(stdlib.glob("*.py"))[:30]):
        (corpus / f"{i:03d}.txt").write_text(path.read_text(errors="replace"))
    assert cli.main(["data", "prepare", str(corpus), "--out", str(base / "shards"),
                     "--vocab-size", "512", "--val-fraction", "0.2", "--no-progress"]) == 0
    (base / "tiny.yaml").write_text(TINY)
    return base


def torchrun(work: Path, args: list[str], *, fault: str = "", digest: str = "",
             restarts: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               TRAINPLAN_FAULT=fault, TRAINPLAN_DIGEST=digest,
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", str(restarts), "-m", "trainplan.train",
           "--model", str(work / "tiny.yaml"), "--data", str(work / "shards"), *RUN, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def summary(proc) -> dict:
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def digests(root: Path) -> dict[int, str]:
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["digest"] for e in events if e["event"] == "digest"}


@pytest.fixture(scope="module")
def reference(work) -> dict:
    """The uninterrupted run, exported at the end."""
    root = work / "ref"
    proc = torchrun(work, ["--steps", str(STEPS), "--ckpt-dir", str(root), "--ckpt-every",
                           str(EVERY), "--ckpt-keep", "3", "--log-dir", str(work / "logs"),
                           "--export", str(work / "hf")], digest=str(STEPS))
    return {"summary": summary(proc), "root": root, "stderr": proc.stderr}


def test_loss_falls_and_logs_are_written(reference, work):
    s = reference["summary"]
    assert len(s["losses"]) == STEPS
    assert sum(s["losses"][-3:]) / 3 < sum(s["losses"][:3]) / 3 - 0.3  # it learns
    assert [e["step"] for e in s["evals"]] == [6, 12]
    assert s["evals"][1]["eval_loss"] < s["evals"][0]["eval_loss"]
    rows = [json.loads(x) for x in (work / "logs" / "training.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3, 6, 9, 12]
    assert any(p.name.startswith("events.out.tfevents") for p in (work / "logs" / "tb").iterdir())
    assert "step 12/12 | loss" in reference["stderr"] and "ETA" in reference["stderr"]


def test_summary_names_what_a_loss_comparison_needs(reference):
    """The summary says the run's seed, schedule, card, sequence and speed: what
    `runbook.parity` reads to compare runs of two precisions."""
    s = reference["summary"]
    assert (s["seed"], s["card"], s["seq_len"], s["precision"]) == (0, "cpu", 32, "bf16")
    assert s["lr"]["schedule"] == "cosine" and s["lr"]["peak"] > 0
    assert s["step_time_s"] > 0
    assert s["tokens_per_s_per_gpu"] == pytest.approx(s["tokens_per_step"] / s["step_time_s"] / 2)


def test_kill_and_resume_is_bit_identical(reference, work):
    """Killed in step 7 (after the checkpoint of step 4), restarted by torchrun with --resume:
    the same model and optimizer state at the end, the same losses from step 5 on, and every
    rank's data position in the checkpoint it resumed from."""
    root = work / "killed"
    proc = torchrun(work, ["--steps", str(STEPS), "--ckpt-dir", str(root), "--ckpt-every",
                           str(EVERY), "--ckpt-keep", "3", "--resume"],
                    fault="kill@step:7:rank:1", digest=str(STEPS), restarts=1)
    s = summary(proc)
    assert s["first_step"] == EVERY + 1
    assert s["losses"] == reference["summary"]["losses"][EVERY:]
    assert digests(root)[STEPS] == digests(reference["root"])[STEPS]
    saved = json.loads((root / "step-000008" / "rank-00001.json").read_text())
    data = saved["extra"]["data"]["samplers"][0]
    assert data["world"] == 2 and data["position"] == 8 * 2 * 2  # 8 steps x 2 micro x 2 rows
    assert saved["extra"]["lr_schedule"]["last_epoch"] == 8


def test_export_loads_in_transformers_with_the_same_logits(reference, work):
    import torch
    import transformers

    from trainplan.bench.harness.model import Transformer
    from trainplan.specs import load_model
    from trainplan.train import export

    hf = transformers.LlamaForCausalLM.from_pretrained(work / "hf", torch_dtype=torch.float32)
    ours = Transformer.from_spec(load_model(str(work / "tiny.yaml")), max_seq_len=32)
    export.load_weights(ours, work / "hf")
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, ours(tokens), atol=1e-5,
                                   rtol=1e-5)


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    rc = cli.main(["train", *args])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("change, words", [
    (lambda w: ["--data", str(w / "nowhere")], "trainplan data prepare"),
    (lambda w: ["--model", "llama-1.3b", "--nproc-per-node", "1", "--dp", "1", "--zero", "0"],
     None),  # a 32k vocabulary holds the 512 ids: no error
    (lambda w: ["--tokenizer", str(w / "other.json")], "another tokenizer"),
    (lambda w: ["--data", f"{w / 'shards'}:-1"], "weight"),
    (lambda w: ["--lr-warmup", "99"], "--lr-warmup"),
    (lambda w: ["--dp", "3"], "ranks"),
])
def test_bad_input_is_one_line(work, capsys, change, words):
    (work / "other.json").write_text((work / "shards" / "tokenizer.json").read_text()
                                     .replace('"<|endoftext|>"', '"<|eot|>"'))
    args = ["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"), "--steps", "4",
            "--nproc-per-node", "2", "--dp", "2", "--dry-run", "--cpu", *change(work)]
    rc, err = run_cli(args, capsys)
    if words is None:
        assert rc == 0, err
        return
    assert rc == 2 and words in err and len(err.splitlines()) == 1, err


def test_small_vocabulary_model_refuses_the_shards(work, capsys):
    small = work / "small.yaml"
    small.write_text(TINY.replace("vocab: 512", "vocab: 256"))
    rc, err = run_cli(["--model", str(small), "--data", str(work / "shards"), "--steps", "4",
                       "--dry-run", "--cpu", "--zero", "0"], capsys)
    assert rc == 2 and "512" in err and "256" in err, err


def test_resume_with_another_model_is_refused(reference, work):
    other = work / "wide.yaml"
    other.write_text(TINY.replace("hidden: 64", "hidden: 128"))
    root = work / "copied"
    shutil.copytree(reference["root"], root)
    proc = torchrun(work, ["--model", str(other), "--steps", str(STEPS + 2), "--ckpt-dir",
                           str(root), "--resume"])
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode != 0 and errors and "size" in errors[0].lower(), proc.stderr[-2000:]


def _copy_unverified(reference, dest: Path) -> Path:
    """The reference's checkpoints, each broken in a way its manifest and listing show: a
    shard cut short, a file gone, a manifest edited."""
    from trainplan.bench.ckpt import manifest as mf

    shutil.copytree(reference["root"], dest)
    folders = [d for _, d in mf.step_dirs(dest)]
    assert len(folders) == 3, folders
    shard = next(folders[0].glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    (folders[1] / "rank-00001.json").unlink()
    edited = json.loads((folders[2] / mf.MANIFEST).read_text())
    edited["world_size"] += 1
    (folders[2] / mf.MANIFEST).write_text(json.dumps(edited))
    return dest


def test_resume_where_no_checkpoint_verifies_is_refused_before_torchrun(
        reference, work, capsys, monkeypatch):
    """One line and exit 2 from `trainplan train`, the ranks' own refusal, and no torchrun:
    with --fresh the same folder passes the check."""
    from trainplan.bench.ckpt.store import resume_choice
    from trainplan.commands import training

    root = _copy_unverified(reference, work / "unverified")
    ranks = resume_choice(root, True, False)  # what rank 0 says, the shards read
    assert ranks[0] == "error", ranks
    before = sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*"))
    started = []
    monkeypatch.setattr(training, "run_torchrun", lambda *a, **k: started.append(a))
    args = ["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"), "--steps",
            str(STEPS + 4), "--nproc-per-node", "2", "--dp", "2", "--zero", "3", "--cpu",
            "--ckpt-dir", str(root)]
    rc, err = run_cli([*args, "--resume"], capsys)
    print(err)
    assert rc == 2 and len(err.splitlines()) == 1 and not started, err
    assert err == f"trainplan: error: {ranks[1]}", err
    assert "--resume: no verified checkpoint in " in err and "(truncated?)" in err
    assert "pass --fresh to start at step 0 anyway" in err
    rc, err = run_cli([*args], capsys)  # no --resume: the folder's checkpoints would be lost
    assert rc == 2 and "already holds checkpoints" in err and not started, err
    rc, err = run_cli([*args, "--resume", "--fresh", "--dry-run"], capsys)
    assert rc == 0 and not started, err
    assert sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*")) == before


def test_the_check_before_torchrun_leaves_hashes_to_the_ranks(reference, work):
    """The check reads manifests and listings, not the shards: a bit flipped inside a shard
    passes it (the ranks' full verification refuses it), a shard cut short does not."""
    from trainplan.bench.ckpt import manifest as mf
    from trainplan.bench.ckpt.store import resume_choice

    root = work / "flipped"
    shutil.copytree(reference["root"], root)
    for _, folder in mf.step_dirs(root):
        shard = next(folder.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    assert resume_choice(root, True, False, contents=False)[0] == "ok"
    full = resume_choice(root, True, False)
    assert full[0] == "error" and "sha256 mismatch" in full[1], full
    cut = _copy_unverified(reference, work / "cut")
    assert resume_choice(cut, True, False, contents=False) == resume_choice(cut, True, False)


def _one_process(work: Path, *flags: str) -> dict:
    """Three steps in this process (one rank, no wrapper): the trainer's summary."""
    from trainplan.train import loop

    return loop.run(loop.parse_args([
        "--model", str(work / "tiny.yaml"), "--data", str(work / "shards"), "--steps", "3",
        "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--dp", "1", "--zero",
        "0", "--lr", "3e-3", "--eval-every", "3", "--eval-batches", "1", "--cpu",
        "--no-progress", *flags]))


def test_fused_loss_trains_as_the_standard_loss(work):
    """--loss fused reaches the harness's build: the same losses and held-out loss (fp32 on
    CPU; the chunked sums differ only in order), and the summary names the loss."""
    fused = _one_process(work, "--loss", "fused", "--loss-chunk", "24")
    standard = _one_process(work)
    assert fused["loss"] == "fused" and standard["loss"] == "standard"
    assert fused["losses"] == pytest.approx(standard["losses"], rel=1e-5)
    assert fused["evals"][0]["eval_loss"] == pytest.approx(standard["evals"][0]["eval_loss"],
                                                           rel=1e-5)


@pytest.mark.parametrize("flags, words", [
    (["--loss", "fused", "--tp", "2"], "--loss fused with --tp 2"),
    (["--loss", "fused", "--pp", "2"], "--loss fused with --pp 2"),
    (["--loss", "bogus", "--dp", "2"], "argument --loss: invalid choice: 'bogus' (choose from "
                                      "'standard', 'fused')"),
])
def test_loss_refusals_are_one_line_before_torchrun(work, capsys, flags, words):
    rc, err = run_cli(["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"),
                       "--steps", "4", "--nproc-per-node", "2", "--dry-run", "--cpu", *flags],
                      capsys)
    assert rc == 2 and words in err and len(err.splitlines()) == 1, err


def test_fused_loss_reaches_the_trainer_command(work, capsys):
    rc = cli.main(["train", "--model", str(work / "tiny.yaml"), "--data", str(work / "shards"),
                   "--steps", "4", "--nproc-per-node", "2", "--dp", "2", "--dry-run", "--cpu",
                   "--loss", "fused", "--loss-chunk", "16"])
    out = capsys.readouterr().out
    assert rc == 0 and "--loss fused --loss-chunk 16" in out, out


def test_rates_leave_out_the_first_step_and_need_two():
    """The summary's step time is the median after the first (compile) step, per GPU rate
    from it; a run of one step has neither."""
    from trainplan.train.loop import rates

    got = rates([9.0, 1.0, 3.0, 2.0], tokens_per_step=600, world=3)
    assert got == {"step_time_s": 2.0, "tokens_per_s_per_gpu": 100.0}
    assert rates([9.0], tokens_per_step=600, world=3) == {"step_time_s": None,
                                                          "tokens_per_s_per_gpu": None}


def test_trainer_runs_the_collector_at_step_starts(work):
    """The trainer's --gc (bench.harness.host): by default a young collection starts every
    step and nothing collects on its own; --gc python leaves CPython's collector on."""
    import gc

    got = _one_process(work)["gc"]
    assert got["mode"] == "step" and len(got["pause_s"]) == 3
    assert got["collections"][1] >= 3 and got["collections"][2] == 0
    assert _one_process(work, "--gc", "python")["gc"]["mode"] == "python"
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_trainer_refuses_gc_every_zero_in_one_line(work, capsys):
    rc, err = run_cli(["--model", str(work / "tiny.yaml"), "--data", str(work / "shards"),
                       "--steps", "4", "--nproc-per-node", "2", "--dry-run", "--cpu",
                       "--gc-full-every", "0"], capsys)
    assert rc == 2 and "--gc-full-every: '0' is not valid: it must be > 0" in err, err
    assert len(err.splitlines()) == 1
