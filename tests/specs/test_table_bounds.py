"""Rows of the measured tables in GPU, cluster and calibration files: each value in a physical
range (`specs.bounds.TABLES`, `CURVES`), a bad row refused in one line that names the file, the
field, the row and what is valid, with exit code 2."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import yaml

from conftest import ROOT, easy_cluster, easy_gpu
from trainplan.calibrate import store
from trainplan.cli import main
from trainplan.errors import SpecError
from trainplan.specs import GPUSpec, preset_names

GPU = (ROOT / "data" / "hardware" / "h100-sxm.yaml").read_text()
CLUSTER = (ROOT / "data" / "clusters" / "dgx-h100.yaml").read_text()
CALIBRATION = yaml.safe_load((ROOT / "data" / "hardware" / "calibration" /
                              "h200-sxm.yaml").read_text())
PLAN = ["plan", "--model", "llama-13b", "--gpus", "32", "--seq-len", "4096",
        "--global-batch-tokens", "4194304"]


def refused(argv, capsys, *fragments: str) -> str:
    """Run the CLI; it must exit 2 with one stderr line holding every fragment."""
    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


# (field, YAML rows, what the line must name: the bad value and the valid range)
GPU_ROWS = [
    ("activation_scales", "[[true, full, 1.0e+308]]", "1e+308", "scale 0.0001 to 10000"),
    ("activation_scales", "[[maybe, none, 1.0]]", "'maybe'", "compiled false|true"),
    ("matmul_curve", "[[1, 1, 1.0e-300]]", "1e-300", "fraction of peak 0.0001 to 1"),
    ("head_matmul_curve", "[[1.0e+300, 1, 0.5]]", "1e+300", "tokens 1 to 2^40"),
    ("fp8_matmul_curve", "[[2048, 1.0e+300, 0.5]]", "1e+300", "width 1 to 2^48"),
    ("fp8_rowwise_matmul_curve", "[[1.0e-300, 1, 0.5]]", "1e-300", "tokens 1 to 2^40"),
    ("attention_curve", "[[4096, 1.0e-300]]", "1e-300", "fraction of peak 0.0001 to 1"),
    ("attention_curve", "[[1.0e+300, 0.5]]", "1e+300", "seq 1 to 2^24"),
    ("collectives", "[[all_reduce, 1.0e+308, 300]]", "1e+308", "latency_us 0 to 1e+06"),
    ("collectives", "[[all_gather, 10, 1.0e+300]]", "1e+300", "busbw_gbps 1e-06 to 1e+15"),
    ("collectives", "[[allreduce, 10, 300]]", "'allreduce'", "op all_reduce|"),
    ("host_block_s", "[[plain, 1.0e+308]]", "1e+308", "seconds 0 to 10"),
    ("host_block_s", "[[fsdp, 0.001]]", "'fsdp'", "wrapper plain|fsdp2|tpN|tpN+fsdp2"),
    ("host_step_s", "[[tp2, 1.0e+308]]", "1e+308", "seconds 0 to 10"),
    ("host_step_layer_s", "[[tp2+fsdp2, 1.0e+308]]", "1e+308", "seconds 0 to 10"),
    ("ring_host_s", "[[2, 0, 1.0e+308]]", "1e+308", "seconds 0 to 10"),
    ("ring_host_s", "[[2, 7, 0.001]]", "compiled = 7", "compiled false|true"),
    ("ring_host_s", "[[1.0e+300, 1, 0.001]]", "1e+300", "cp 2 to 2^20"),
    ("tp_block_scales", "[[2, 0, 1.0e+308]]", "1e+308", "scale 0.0001 to 10000"),
    ("tp_block_scales", "[[2, 5, 1.0]]", "with FSDP2 = 5", "with FSDP2 false|true"),
    ("fragmentation_scales", "[[plain, 1.0e+308]]", "1e+308", "scale 0 to 10000"),
    ("fragmentation_scales", "[[plain:z3, 0.5]]", "'plain:z3'", ":z3 after fsdp2"),
]


@pytest.mark.parametrize("field, rows, value, valid", GPU_ROWS)
def test_a_bad_row_in_a_gpu_yaml_is_one_line_naming_it(tmp_path, capsys, field, rows, value,
                                                       valid):
    gpu = tmp_path / "card.yaml"
    gpu.write_text(f"{GPU}{field}: {rows}\n")
    refused([*PLAN, "--gpu", gpu, "--cluster", "dgx-h100"], capsys,
            str(gpu), f"GPUSpec.{field}[0] = [", value, valid)


def test_a_huge_activation_scale_no_longer_breaks_the_search(tmp_path, capsys):
    """Every compiled row at 1e308 made every layout's memory NaN; the search raised."""
    gpu = tmp_path / "card.yaml"
    gpu.write_text(GPU + "activation_scales:\n" + "".join(
        f"- [true, {rc}, 1.0e+308]\n" for rc in ("none", "selective", "full")))
    refused([*PLAN, "--gpu", gpu, "--cluster", "dgx-h100"], capsys,
            "GPUSpec.activation_scales[0]", "1e+308")


def test_launch_refuses_a_tiny_matmul_fraction_and_writes_nothing(tmp_path, capsys):
    """A fraction of 1e-300 priced every step as NaN seconds; launch raised on it."""
    gpu, out = tmp_path / "card.yaml", tmp_path / "job"
    gpu.write_text(GPU + "matmul_curve: [[1, 1, 1.0e-300]]\n")
    refused(["launch", "--model", "llama-13b", "--gpu", gpu, "--cluster", "dgx-h100",
             "--gpus", "32", "--seq-len", "4096", "--global-batch-tokens", "4194304",
             "--target", "slurm", "--out", out, "--synthetic", "--steps", "100"], capsys,
            "GPUSpec.matmul_curve[0]", "1e-300", "fraction of peak 0.0001 to 1")
    assert not out.exists()


@pytest.mark.parametrize("edit, value, valid", [
    ("collectives: [[all_reduce, 1.0e+308, 300]]", "1e+308", "latency_us 0 to 1e+06"),
    ("collectives: [[all_gather, 30, 0]]", "busbw_gbps = 0", "busbw_gbps 1e-06 to 1e+15"),
    ("inter_node_latency_us: 1.0e+9", "1000000000.0", "0 to 1e+06"),
])
def test_a_bad_cluster_table_or_latency_is_one_line(tmp_path, capsys, edit, value, valid):
    """A collective latency of 1e308 us printed a step time of some 300 digits."""
    cluster = tmp_path / "fabric.yaml"
    key = edit.split(":")[0]
    cluster.write_text(re.sub(rf"^{key}: .*\n", "", CLUSTER, flags=re.M) + edit + "\n")
    refused(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "h100-sxm", "--cluster",
             cluster], capsys, str(cluster), "ClusterSpec.", value, valid)


@pytest.mark.parametrize("field", ["fp8_cast_scale", "fp8_rowwise_cast_scale",
                                   "fp8_activation_ratio", "fp8_rowwise_activation_ratio"])
def test_fp8_scales_have_a_range(field):
    with pytest.raises(SpecError, match=rf"GPUSpec\.{field} = 1e\+308 is out of range; "
                                        "use 0.0001 to 10000"):
        easy_gpu(**{field: 1e308})


# ---------------------------------------------------------------- calibration files


def _edit_pieces(key, value):
    return lambda cal: cal["pieces"].__setitem__(key, value)


def _edit_collective(key, value):
    return lambda cal: cal["collectives"]["all_reduce"].__setitem__(key, value)


@pytest.mark.parametrize("edit, names, value, valid", [
    (_edit_pieces("activation_scales", [[True, "full", 1e308]]),
     "pieces.activation_scales[0]", "1e+308", "scale 0.0001 to 10000"),
    (_edit_pieces("matmul_curve", [[1, 1, 1e-300]]),
     "pieces.matmul_curve[0]", "1e-300", "fraction of peak 0.0001 to 1"),
    (_edit_pieces("host_block_s", [["plain", 1e308]]),
     "pieces.host_block_s[0]", "1e+308", "seconds 0 to 10"),
    (_edit_pieces("autocast_activation_scales", [[True, "none", 1e308]]),
     "pieces.autocast_activation_scales[0]", "1e+308", "scale 0.0001 to 10000"),
    (_edit_pieces("fsdp_block_scales", [[9, 1.0]]),
     "pieces.fsdp_block_scales[0]", "zero = 9", "zero 1|2|3"),
    (_edit_pieces("ddp_exposed", "lots"), "pieces.ddp_exposed", "'lots'", "0 to 1"),
    (_edit_pieces("fp8_cast_scale", 1e308), "pieces.fp8_cast_scale", "1e+308", "0.0001 to 10000"),
    (_edit_pieces("matmul_curve", 0.5), "pieces.matmul_curve", "0.5", "a list of rows"),
    (_edit_collective("latency_us", 1e308), "collectives.all_reduce.latency_us", "1e+308",
     "0 to 1e+06"),
    (_edit_collective("busbw_gbps", 1e300), "collectives.all_reduce.busbw_gbps", "1e+300",
     "1e-06 to 1e+15"),
    (lambda cal: cal.__setitem__("memory_efficiency", 5), "memory_efficiency", "5",
     "0.0001 to 1"),
    (lambda cal: cal.__setitem__("pieces", [1, 2]), "pieces", "[1, 2]", "a mapping"),
    (_edit_pieces("matmul_curv", [[1, 1, 0.5]]), "pieces.'matmul_curv'", "not a piece",
     "trainplan calibrate"),
])
def test_a_bad_row_in_a_calibration_file_is_one_line_naming_it(tmp_path, capsys, edit, names,
                                                               value, valid):
    cal = copy.deepcopy(CALIBRATION)
    edit(cal)
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(cal, sort_keys=False))
    refused(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "h200-sxm",
             "--calibration", path], capsys, f"{path}: {names}", value, valid)


# ---------------------------------------------------------------- what stays valid


def test_every_committed_preset_and_calibration_is_in_range():
    for name in preset_names(GPUSpec):
        gpu = store.load_gpu(name)
        assert all(math.isfinite(s) for *_, s in gpu.activation_scales)
    for path in sorted((ROOT / "data" / "hardware" / "calibration").glob("*.yaml")):
        assert store.load(path.stem, path)["gpu"] == path.stem


def test_the_ends_of_every_range_are_accepted():
    gpu = easy_gpu(
        activation_scales=((True, "none", 1e-4), (False, "full", 1e4), (1, "selective", 1.0)),
        matmul_curve=((1, 1, 1e-4), (2**40, 2**48, 1.0)),
        attention_curve=((1, 1e-4), (2**24, 1.0)),
        collectives=(("all_reduce", 0.0, 1e-6), ("all_to_all", 1e6, 1e15)),
        host_block_s=(("plain", 0.0), ("tp8+fsdp2", 10.0)),
        ring_host_s=((2, 0, 0.0), (2**20, 1, 10.0)),
        tp_block_scales=((1, 0, 1e-4), (2**20, 1, 1e4)),
        fragmentation_scales=(("fsdp2:z3", 0.0), ("tp2+fsdp2:z3", 1e4), ("tp4", 0.5)))
    assert len(gpu.matmul_curve) == 2
    assert easy_cluster(intra_node_latency_us=1e6, collectives=(("all_gather", 1e6, 1e15),))


def test_the_cost_model_stays_finite_at_the_ends_of_the_ranges(tmp_path, capsys):
    """The slowest rows every range allows still price each layout in finite seconds."""
    gpu = tmp_path / "slow.yaml"
    gpu.write_text(GPU + "matmul_curve: [[1, 1, 0.0001]]\nattention_curve: [[1, 0.0001]]\n"
                   "collectives: [[all_reduce, 1000000, 0.000001], [all_gather, 1000000, "
                   "0.000001], [reduce_scatter, 1000000, 0.000001]]\n"
                   "host_block_s: [[plain, 10], [fsdp2, 10]]\nhost_step_s: [[plain, 10]]\n")
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", str(gpu), "--cluster",
                 "dgx-h100", "--json", "--top", "3"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(math.isfinite(p["step_time_s"]) and p["step_time_s"] < 1e12
                         for p in plans)
