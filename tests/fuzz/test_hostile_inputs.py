"""Each careless or hostile input of issue 24's first part, as a user would give it: exit 2
and one line of at most 300 characters within 10 s and 1 GiB (`conftest.broken`), and
where the issue found a silent surprise, the surprise gone.

The CLI runs in a forked child of a warmed-up helper (`runner.py`), so the time and
memory measured are the run's own, not the interpreter's start.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fuzz.conftest import broken

ROOT = Path(__file__).resolve().parents[2]
MODEL = (ROOT / "data" / "models" / "llama-7b.yaml").read_text()
GPU = (ROOT / "data" / "hardware" / "h100-sxm.yaml").read_text()
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 128\nvocab: 256\n"


def alias_bomb(levels: int, width: int = 9) -> list[str]:
    """YAML flow lists, each level `width` aliases of the one before: width**levels leaves."""
    rows = ["&a0 [" + ", ".join(['"lol"'] * width) + "]"]
    rows += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return rows


def bomb_in_a_field(levels: int) -> str:
    return TINY + "source: [" + ", ".join(alias_bomb(levels)) + "]\n"


def bomb_as_a_list(levels: int) -> str:
    return "".join(f"- {row}\n" for row in alias_bomb(levels))


def _write(folder: Path, name: str, content) -> Path:
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _refused(cli_runner, folder: Path, argv, *fragments: str) -> str:
    """Run `argv` in `folder`; it must keep the contract with exit 2; return the line."""
    result = cli_runner.run(argv, folder)
    assert broken(result) is None, broken(result)
    assert result["rc"] == 2, result
    line = result["stderr"].strip()
    for fragment in fragments:
        assert fragment in line, line
    return line


# ---------------------------------------------------------------- YAML bombs and big values


@pytest.mark.parametrize("text", [bomb_in_a_field(9), bomb_as_a_list(9), bomb_as_a_list(7),
                                  TINY + "name: &n x\nsource: *n\n"],
                         ids=["field-9-levels", "list-9-levels", "list-7-levels", "one-alias"])
@pytest.mark.parametrize("verb", ["plan", "memory", "launch"])
def test_alias_bomb_as_a_model_file(cli_runner, tmp_path, text, verb):
    assert len(text.encode()) < 700  # a few hundred bytes that expand to gigabytes
    model = _write(tmp_path, "bomb.yaml", text)
    argv = {"plan": ["plan", "--model", model, "--gpu", "h100-sxm", "--gpus", "8"],
            "memory": ["memory", "--model", model, "--gpu", "h100-sxm"],
            "launch": ["launch", "--model", model, "--gpu", "h100-sxm", "--gpus", "8",
                       "--target", "torchrun", "--out", tmp_path / "out", "--steps", "10"]}[verb]
    _refused(cli_runner, tmp_path, argv, "alias", "bomb.yaml")
    assert not (tmp_path / "out").exists()


def test_a_megabyte_string_value_is_refused_in_a_short_line(cli_runner, tmp_path):
    model = _write(tmp_path, "long.yaml", TINY + "source: " + "x" * 1_000_000 + "\n")
    line = _refused(cli_runner, tmp_path, ["plan", "--model", model, "--gpu", "h100-sxm",
                                           "--gpus", "8"], "1,000,000 characters")
    assert len(line) < 200


@pytest.mark.parametrize("field, value", [("name", "y" * 5000), ("ffn", "[" + "1, " * 3000 + "1]"),
                                          ("hidden", "9" * 5000)])
def test_a_long_bad_value_is_quoted_short(cli_runner, tmp_path, field, value):
    text = re.sub(rf"^{field}: .*$", f"{field}: {value}", TINY + "name: t\n", flags=re.M)
    model = _write(tmp_path, "m.yaml", text)
    line = _refused(cli_runner, tmp_path, ["memory", "--model", model, "--gpu", "h100-sxm"])
    assert len(line) < 240 and field in line


# ---------------------------------------------------------------- numbers out of range


@pytest.mark.parametrize("hidden", [4294967296, 2**40, 2**63, 10**30])
@pytest.mark.parametrize("verb", ["plan", "memory", "launch"])
def test_huge_integers_in_a_model(cli_runner, tmp_path, hidden, verb):
    model = _write(tmp_path, "huge.yaml", MODEL.replace("hidden: 4096", f"hidden: {hidden}"))
    argv = {"plan": ["plan", "--model", model, "--gpu", "h100-sxm", "--gpus", "8"],
            "memory": ["memory", "--model", model, "--gpu", "h100-sxm"],
            "launch": ["launch", "--model", model, "--gpu", "h100-sxm", "--gpus", "8",
                       "--target", "torchrun", "--out", tmp_path / "out", "--steps", "10"]}[verb]
    _refused(cli_runner, tmp_path, argv, "hidden")


def test_a_model_too_large_as_a_whole(cli_runner, tmp_path):
    """Each field in range, the product not: about 2**56 parameters."""
    model = _write(tmp_path, "big.yaml", "n_layers: 16384\nhidden: 65536\nn_heads: 64\n"
                                         "ffn: 262144\nvocab: 32000\n")
    _refused(cli_runner, tmp_path, ["memory", "--model", model, "--gpu", "h100-sxm"],
             "parameters is too many")


@pytest.mark.parametrize("flag, value", [("--micro-batch", "1e9"), ("--seq-len", "1e12")])
@pytest.mark.parametrize("verb", ["plan", "memory"])
def test_absurd_run_sizes_are_refused_alike(cli_runner, tmp_path, flag, value, verb):
    argv = [verb, "--model", "llama-7b", "--gpu", "h100-sxm", flag, value]
    argv += ["--gpus", "8"] if verb == "plan" else []
    _refused(cli_runner, tmp_path, argv, f"{flag} {int(float(value))} is not valid; use 1 to")


@pytest.mark.parametrize("value", ["1.0e-300", "1.0e+308", ".inf", ".nan"])
@pytest.mark.parametrize("field", ["bf16_tflops", "matmul_efficiency", "hbm_tbps"])
def test_gpu_yaml_of_absurd_numbers(cli_runner, tmp_path, field, value):
    gpu = _write(tmp_path, "g.yaml", re.sub(rf"^{field}: .*$", f"{field}: {value}", GPU,
                                            flags=re.M))
    _refused(cli_runner, tmp_path, ["plan", "--model", "llama-7b", "--gpu", gpu, "--gpus", "8",
                                    "--cluster", "dgx-h100"], f"GPUSpec.{field}")


# ---------------------------------------------------------------- binary files, journals


BINARY = bytes(range(256)) * 8


@pytest.mark.parametrize("argv", [
    ["tune", "--suite", "{f}", "--storage", "{d}/s.journal", "--gpu-hours", "1"],
    ["validate", "--suite", "{f}", "--gpus", "2", "--out", "{d}/v"],
    ["bench", "--suite", "{f}", "--out", "{d}/b"],
    ["tune", "--report", "--storage", "{f}"],
    ["suggest", "--model-size", "7B", "--gpus", "8", "--dataset-tokens", "2e9", "--study", "{f}"],
], ids=["tune-suite", "validate-suite", "bench-suite", "tune-report-storage", "suggest-study"])
@pytest.mark.parametrize("content", [BINARY, "\ufeffname: x\n".encode("utf-16")],
                         ids=["binary", "utf-16"])
def test_binary_or_non_utf8_suites_and_studies(cli_runner, tmp_path, argv, content):
    f = _write(tmp_path, "input.yaml", content)
    argv = [a.format(f=f, d=tmp_path) for a in argv]
    _refused(cli_runner, tmp_path, argv, "not UTF-8")
    assert not (tmp_path / "v").exists() and not (tmp_path / "b").exists()


COMMITTED = (ROOT / "data" / "measurements" / "tune-2gpu" / "study.journal").read_text()


@pytest.mark.parametrize("edit", [
    lambda lines: lines[:3] + ["{not json"] + lines[3:],
    lambda lines: lines[:3] + [json.dumps({"op_code": 4, "worker_id": "w"})] + lines[3:],
    lambda lines: [json.dumps({"op_code": 0, "worker_id": "w", "study_name": "s"})],
    lambda lines: lines[:3] + ['{"op_code": 99, "worker_id": "w"}'] + lines[3:],
    lambda lines: lines[:3] + ['[1, 2]'] + lines[3:],
], ids=["bad-json", "trial-without-fields", "study-without-directions", "unknown-op", "list"])
@pytest.mark.parametrize("verb", ["tune", "suggest"])
def test_a_journal_with_one_bad_line(cli_runner, tmp_path, edit, verb):
    journal = _write(tmp_path, "study.journal", "\n".join(edit(COMMITTED.splitlines())) + "\n")
    argv = (["tune", "--report", "--storage", journal] if verb == "tune" else
            ["suggest", "--model-size", "7B", "--gpus", "8", "--dataset-tokens", "2e9",
             "--study", journal])
    _refused(cli_runner, tmp_path, argv, "study.journal")


def test_the_committed_journal_still_reads(cli_runner, tmp_path):
    result = cli_runner.run(["tune", "--report", "--json"], tmp_path)
    assert broken(result) is None and result["rc"] == 0, result
    assert json.loads(result["stdout"])["trials"] > 0


def test_a_checkpoint_manifest_nested_deep(cli_runner, tmp_path):
    """Found by the fuzz test: json's decoder recursed past Python's limit (a traceback)."""
    (tmp_path / "ckpt").mkdir()
    _write(tmp_path / "ckpt", "manifest.json", "[" * 5000)
    _refused(cli_runner, tmp_path, ["export", "--ckpt", tmp_path / "ckpt", "--model",
                                    "llama-1.3b", "--out", tmp_path / "hf"], "nested too deeply")
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- launch


def test_launch_into_an_unwritable_folder(cli_runner, tmp_path):
    _refused(cli_runner, tmp_path, ["launch", "--scenario", "llama-13b-32xh100", "--target",
                                    "torchrun", "--out", "/proc/x"], "/proc", "cannot write")


@pytest.mark.parametrize("image", ["a\nkind: Secret", "a b", "trainplan:0.1.0\r", "x" * 300,
                                   "Ubuntu:latest", "img:tag;rm -rf /"])
def test_launch_k8s_refuses_an_image_that_is_not_a_reference(cli_runner, tmp_path, image):
    _refused(cli_runner, tmp_path, ["launch", "--scenario", "llama-13b-32xh100", "--target",
                                    "k8s", "--image", image, "--out", tmp_path / "k"], "--image")
    assert not (tmp_path / "k").exists()


# ---------------------------------------------------------------- no silent surprises


def _ok(cli_runner, folder, argv) -> tuple[dict, str]:
    result = cli_runner.run([*argv, "--json"], folder)
    assert broken(result) is None and result["rc"] == 0, result
    return json.loads(result["stdout"]), result["stderr"]


def test_the_cluster_follows_the_gpu_and_is_said(cli_runner, tmp_path):
    out, err = _ok(cli_runner, tmp_path, ["plan", "--model", "llama-7b", "--gpu", "a100-80gb",
                                          "--gpus", "8", "--top", "1"])
    assert out["cluster"] == "dgx-a100"
    assert err.splitlines() == ["trainplan: --cluster dgx-a100 (the cluster of --gpu a100-80gb; "
                                "pass --cluster to choose another)"]
    _, err = _ok(cli_runner, tmp_path, ["memory", "--model", "llama-7b", "--gpu", "h100-sxm",
                                        "--cluster", "dgx-a100"])
    assert err == ""  # a cluster given is not noted


def test_a_gpu_file_that_names_no_cluster_needs_one(cli_runner, tmp_path):
    gpu = _write(tmp_path, "mine.yaml", GPU.replace("cluster: dgx-h100", ""))
    _refused(cli_runner, tmp_path, ["plan", "--model", "llama-7b", "--gpu", gpu, "--gpus", "8"],
             "--cluster is needed")


def test_a_gpu_file_named_like_a_preset_gets_no_calibration(cli_runner, tmp_path):
    (tmp_path / "u").mkdir()
    gpu = _write(tmp_path / "u", "h100-sxm.yaml", GPU)
    argv = ["plan", "--model", "llama-7b", "--gpus", "8", "--top", "1", "--gpu"]
    mine, _ = _ok(cli_runner, tmp_path, [*argv, gpu])
    preset, _ = _ok(cli_runner, tmp_path, [*argv, "h100-sxm"])
    assert mine["calibration"] == "datasheet"
    assert preset["calibration"].startswith("h100-sxm (")
    cal = ROOT / "data" / "hardware" / "calibration" / "h100-sxm.yaml"
    named, _ = _ok(cli_runner, tmp_path, [*argv, gpu, "--calibration", cal])
    assert named["calibration"] == preset["calibration"]
    assert named["plans"][0]["step_time_s"] == preset["plans"][0]["step_time_s"]
