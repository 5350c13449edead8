"""Instruction data in the proxy harness: the loader, its refusals, the records cache, and the
harness end to end under torchrun (2 gloo ranks, FSDP2) packed and padded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from trainplan.bench.harness import data, train
from trainplan.cli import main
from trainplan.data import instruct
from trainplan.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 320  # the loader tests' tokenizer (tests/bench/test_data.py): one shared cache build
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 320\n"


@pytest.fixture(scope="module")
def records_file(tmp_path_factory) -> Path:
    """Records of the stdlib's json package and the reference topics (real, varied text)."""
    recs = instruct.stdlib_records(0, root=Path(sysconfig.get_paths()["stdlib"]) / "json")
    return instruct.write_records(recs, tmp_path_factory.mktemp("rec") / "records.jsonl")


def loader(records_file, **kw):
    args = dict(seq_len=64, micro_batch=4, rank=0, world=1, seed=0, vocab=VOCAB,
                data="instruct", records=str(records_file))
    return data.build_loader(**{**args, **kw})


@pytest.mark.parametrize("pack", [True, False])
def test_instruct_batches_mask_the_prompt_and_say_what_they_are(shared_cache, records_file,
                                                                pack):
    dl = loader(records_file, pack=pack, num_workers=1)
    x, y = next(iter(dl))
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    share = float((y != -100).float().mean())
    assert 0 < share < 1  # some positions are prompt (and, padded, padding)
    assert int(x.max()) < VOCAB and int(y[y != -100].min()) >= 0
    info = dl.dataset.info
    assert info["pack"] is pack and info["source"] == str(records_file)
    assert info["records"] == len(instruct.read_records(records_file))
    assert info["rows"] == len(dl.dataset) and (info["rows"] == info["records"]) is not pack


@pytest.mark.parametrize("kw, needle", [
    ({"data": "chat"}, "data = 'chat' is not valid"),
    ({"data": "stdlib", "pack": False}, "for data = 'instruct' only"),
    ({"data": "stdlib", "records": "x.jsonl", "pack": True}, "for data = 'instruct' only"),
    ({"synthetic": True}, "synthetic=True makes its own tokens"),
    ({"pack": "yes"}, "pack = 'yes' is not valid"),
])
def test_bad_instruct_arguments_are_one_line(shared_cache, records_file, kw, needle):
    with pytest.raises(SpecError, match=needle):
        loader(records_file, **kw)


def test_stdlib_records_are_made_once_per_seed_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path))
    made, calls = instruct.stdlib_records, []

    def small(seed):
        calls.append(seed)
        return made(seed, limit=30, root=Path(sysconfig.get_paths()["stdlib"]) / "json")

    monkeypatch.setattr(instruct, "stdlib_records", small)
    first = data.instruct_records(1)
    assert data.instruct_records(1) == first and calls == [1]  # read back from the cache
    assert data.instruct_records(2) != first and calls == [1, 2]
    assert len(list(tmp_path.glob("instruct-seed*.jsonl"))) == 2
    assert not list(tmp_path.glob(".*tmp"))


def _harness(*argv, ranks: int = 0, env=None):
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks)] if ranks else [sys.executable]
    env = dict(env or os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([*head, "-m", "trainplan.bench.harness.train", *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("content, needle", [
    (b'{"instruction": "a", "output": "b"}\n', "has no string field 'prompt'"),
    (b'{"prompt": "caf\xe9", "response": "b"}\n', "not UTF-8 text"),
])
def test_a_bad_records_file_is_one_line_and_exit_2(tmp_path, capsys, content, needle):
    """Refused by the harness and by `trainplan bench` before a model or process starts."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    flags = ["--model", str(tmp_path / "tiny.yaml"), "--seq-len", "32", "--steps", "2",
             "--warmup", "1", "--cpu", "--data", "instruct", "--pad", "--instruct-file", str(bad)]
    for run in (lambda: train.main([*flags, "--json"]),
                lambda: main(["bench", *flags, "--dry-run"])):
        assert run() == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and not out.strip()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--pack", "--pad"])
def test_the_harness_trains_on_instruct_rows_under_torchrun(shared_cache, records_file,
                                                            tmp_path, mode):
    (tmp_path / "tiny.yaml").write_text(TINY)
    data.corpus_tokens(VOCAB)  # the tokenizer, built once here rather than by both ranks
    proc = _harness("--model", tmp_path / "tiny.yaml", "--seq-len", 64, "--dp", 2, "--zero", 3,
                    "--micro-batch", 2, "--grad-accum", 2, "--steps", 4, "--warmup", 1,
                    "--lr", "3e-3", "--cpu", "--json", "--data", "instruct", mode,
                    "--instruct-file", records_file, "--num-workers", 1, ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert len(out["losses"]) == 4 and all(math.isfinite(v) for v in out["losses"])
    assert out["loader"]["data"] == "instruct" and out["loader"]["pack"] is (mode == "--pack")
    assert len(out["trained_share"]) == 3 and all(0 < s < 1 for s in out["trained_share"])
    assert out["trained_tokens_per_s_per_gpu"] == pytest.approx(
        out["tokens_per_s_per_gpu"] * sum(out["trained_share"]) / 3)
