"""Host operators by thread: self time from nested spans, per step; the trace reader and the
command's refusals."""

from __future__ import annotations

import gzip
import json

import pytest

from trainplan.bench.observe import host_ops
from trainplan.errors import TrainplanError


def test_self_time_is_the_span_less_its_children():
    # a 0-10 parent with children 2-5 and 6-7, the first with a child 3-4; a 12-13 sibling
    spans = [(0, 10, "step"), (2, 5, "mm"), (3, 4, "cudaLaunchKernel"), (6, 7, "mm"),
             (12, 13, "mm")]
    own, calls = host_ops.self_times(spans)
    assert own == {"step": 6, "mm": 3 + 1 - 1 + 1, "cudaLaunchKernel": 1}
    assert calls == {"step": 1, "mm": 3, "cudaLaunchKernel": 1}
    assert sum(own.values()) == 10 + 1  # the union of the spans: nothing counted twice


def test_equal_starts_nest_the_longer_span_outside():
    own, _ = host_ops.self_times([(0, 4, "inner"), (0, 10, "outer")])
    assert own == {"outer": 6, "inner": 4}


def test_summary_is_per_thread_and_per_step_and_leaves_out_the_step_ranges():
    us = [(1, 0, 1000, "ProfilerStep#3"), (1, 0, 400, "aten::mm"), (1, 100, 110, "cuLaunchKernel"),
          (1, 500, 520, "cudaLaunchKernel"), (2, 0, 900, "autograd::engine"),
          (2, 10, 60, "cuLaunchKernelEx")]
    got = host_ops.summarise(us, steps=2)
    first, second = got["threads"]
    assert (first["thread"], second["thread"]) == ("2", "1")  # the busiest first
    assert first["self_s_per_step"] == pytest.approx(900e-6 / 2)
    assert second["self_s_per_step"] == pytest.approx(420e-6 / 2)  # ProfilerStep# not work
    assert second["launches_per_step"] == 1.0 and first["launches_per_step"] == 0.5
    assert second["ops"][0] == {"name": "aten::mm", "self_s_per_step": pytest.approx(195e-6),
                                "calls_per_step": 0.5}
    assert "thread 2: 0.5 ms a step" in host_ops.table(got)
    with pytest.raises(TrainplanError, match="steps = 0"):
        host_ops.summarise(us, steps=0)


def test_reads_a_gzipped_chrome_trace(tmp_path, capsys):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 7, "ts": 10, "dur": 30},
              {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "tid": 7, "ts": 12, "dur": 5},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 7,
               "ts": 15, "dur": 4}]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    assert host_ops.from_chrome_trace(path) == [(7, 10.0, 40.0, "aten::mm"),
                                                (7, 15.0, 19.0, "cudaLaunchKernel")]
    assert host_ops.main([str(path), "--steps", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["threads"][0]["launches_per_step"] == 1.0


@pytest.mark.parametrize("content", [b"not json", b'{"events": []}', b"\x1f\x8b broken"])
def test_a_file_that_is_no_trace_is_one_line_and_exit_2(tmp_path, capsys, content):
    path = tmp_path / "t.json.gz" if content.startswith(b"\x1f") else tmp_path / "t.json"
    path.write_bytes(content)
    assert host_ops.main([str(path), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: host_ops:") and str(path) in err and "\n" not in err


def test_steps_below_one_are_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        host_ops.main(["x.json", "--steps", "0"])
    assert e.value.code == 2 and "use a whole number >= 1" in capsys.readouterr().err
