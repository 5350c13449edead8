"""Reserved memory by stream (`bench.train.pools_by_stream`): read from a made-up caching-allocator
snapshot, and carried into a measurement record that `trainplan compare` still reads."""

import json

import pytest

from trainplan.bench.harness.monitor import pools_by_stream
from trainplan.compare import accuracy as compare
from trainplan.records import schema as records

GiB = 2**30


def test_pools_sum_each_stream_s_segments_of_this_device_only():
    segments = [
        {"device": 0, "stream": 0, "total_size": 2 * GiB, "allocated_size": GiB},
        {"device": 0, "stream": 0, "total_size": GiB, "allocated_size": 0},
        {"device": 0, "stream": 7, "total_size": 3 * GiB, "allocated_size": GiB // 2},
        {"device": 1, "stream": 0, "total_size": 9 * GiB, "allocated_size": 9 * GiB},
    ]
    got = pools_by_stream(segments, 0)
    assert got == {"0": {"reserved_gib": 3.0, "allocated_gib": 1.0, "segments": 2},
                   "7": {"reserved_gib": 3.0, "allocated_gib": 0.5, "segments": 1}}
    assert pools_by_stream(segments, 1)["0"]["reserved_gib"] == pytest.approx(9.0)
    assert pools_by_stream([], 0) == {}


def test_a_record_with_pools_is_compared_like_any_other(tmp_path):
    rec = records.measurement_record(
        model="llama-1.3b", impl="trainplan",
        layout={"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 2, "micro_batch": 1,
                "grad_accum": 1, "recompute": "none", "compile": True},
        gpus=2, card="NVIDIA H100 80GB HBM3", run_id="r", step_times_s=[0.2, 0.21, 0.19],
        tokens_per_step=4096, flops_per_token=8.9e9, peak_tflops=989.0,
        peak_mem_reserved_gib=18.4, peak_mem_allocated_gib=13.6, warmup_steps_dropped=4,
        extra={"memory_pools": {"0": {"reserved_gib": 15.0, "allocated_gib": 1.0,
                                      "segments": 40}}})
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    out = compare.compare([str(path)], repredictions=False)
    assert out["measured_configs"] == 1
    assert out["rows"][0]["measured_memory_gib"] == pytest.approx(18.4)


def test_peaks_over_ranks_keep_each_rank_and_the_largest_of_each():
    import torch

    from trainplan.bench.harness.monitor import peak_memory, peaks_over_ranks
    # a pipeline: stage 0 reserves the most, stage 1 allocates the most
    got = peaks_over_ranks([[29.123456, 31.84375], [29.790798, 30.5]])
    assert got["peak_mem_allocated_gib"] == 29.790798
    assert got["peak_mem_reserved_gib"] == 31.84375
    assert got["peak_mem_by_rank_gib"] == [[29.1235, 31.8438], [29.7908, 30.5]]
    assert peaks_over_ranks([[1.0, 2.0]])["peak_mem_by_rank_gib"] == [[1.0, 2.0]]
    assert set(peak_memory(torch.device("cpu")).values()) == {None}  # no GPU: nothing measured
