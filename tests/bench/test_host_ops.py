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
    assert own == {"step": 6, "mm": 2 + 1 + 1, "cudaLaunchKernel": 1}
    assert calls == {"step": 1, "mm": 3, "cudaLaunchKernel": 1}
    assert sum(own.values()) == 10 + 1  # the union of the spans: nothing counted twice


def test_adjacent_spans_are_siblings_not_parent_and_child():
    own, _ = host_ops.self_times([(0, 10, "p"), (0, 5, "a"), (5, 8, "b")])
    assert own == {"p": 2, "a": 5, "b": 3}  # b starts where a ends: a's sibling, p's child


def test_equal_starts_nest_the_longer_span_outside():
    own, _ = host_ops.self_times([(0, 4, "inner"), (0, 10, "outer")])
    assert own == {"outer": 6, "inner": 4}


def test_a_child_that_outlasts_its_parent_takes_only_the_shared_part():
    own, _ = host_ops.self_times([(0, 10, "a"), (2, 32, "b")])
    assert own == {"a": 2, "b": 30} and sum(own.values()) == 32  # the union, no negative time


def test_summary_is_per_recorded_step_and_leaves_out_the_step_ranges():
    us = [(1, 0, 1000, "ProfilerStep#3"), (1, 1000, 2000, "ProfilerStep#4"),
          (1, 0, 400, "aten::mm"), (1, 100, 110, "cuLaunchKernel"),
          (1, 500, 520, "cudaLaunchKernel"), (2, 0, 900, "autograd::engine"),
          (2, 10, 60, "cuLaunchKernelEx")]
    got = host_ops.summarise(us)  # two ProfilerStep# ranges: two steps
    first, second = got["threads"]
    assert got["steps"] == 2 and (first["thread"], second["thread"]) == ("2", "1")
    assert first["self_s_per_step"] == pytest.approx(900e-6 / 2)
    assert second["self_s_per_step"] == pytest.approx(420e-6 / 2)  # the ranges are not work
    assert second["launches_per_step"] == 1.0 and first["launches_per_step"] == 0.5
    assert second["ops"][0] == {"name": "aten::mm", "self_s_per_step": pytest.approx(195e-6),
                                "calls_per_step": 0.5}
    assert "thread 2: 0.5 ms a step" in host_ops.table(got)
    assert host_ops.summarise(us, steps=2) == got
    with pytest.raises(TrainplanError, match="records 2 profiler steps, so give 2"):
        host_ops.summarise(us, steps=3)
    with pytest.raises(TrainplanError, match="no ProfilerStep# ranges; give --steps"):
        host_ops.summarise(us[2:])
    assert host_ops.summarise(us[2:], steps=4)["threads"][0]["self_s_per_step"] == \
        pytest.approx(900e-6 / 4)


def test_the_table_escapes_control_characters_in_names():
    got = host_ops.summarise([(1, 0, 10, "ok"), (1, 10, 20, "a\nFAKE LINE\x1b[2J")], steps=1)
    text = host_ops.table(got)
    assert len(text.splitlines()) == 3 and "\\x0aFAKE LINE\\x1b" in text


def _trace(tmp_path, events, name="t.json.gz"):
    path = tmp_path / name
    data = json.dumps({"traceEvents": events}).encode()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


def test_reads_a_gzipped_chrome_trace(tmp_path, capsys):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 7, "ts": 10, "dur": 30},
              {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "tid": 7, "ts": 12, "dur": 5},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 7,
               "ts": 15, "dur": 4},
              {"ph": "X", "cat": "kernel", "name": "odd", "tid": [1], "ts": "x"}]  # not host
    path = _trace(tmp_path, events)
    assert host_ops.from_chrome_trace(path) == [("7", 10.0, 40.0, "aten::mm"),
                                                ("7", 15.0, 19.0, "cudaLaunchKernel")]
    assert host_ops.main([str(path), "--steps", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["threads"][0]["launches_per_step"] == 1.0


@pytest.mark.parametrize("changes", [
    {"ts": "nan"}, {"ts": "12"}, {"dur": -50}, {"ts": True}, {"tid": {"x": 1}}, {"tid": None},
    {"name": 3}, {"ts": 1e308, "dur": 1e308},  # each finite, their sum (the end) is not
])
def test_host_events_with_fields_out_of_kind_are_refused(tmp_path, changes):
    event = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 7, "ts": 10, "dur": 1}
    with pytest.raises(TrainplanError, match=r"traceEvents\[0\] is a host event without"):
        host_ops.from_chrome_trace(_trace(tmp_path, [{**event, **changes}]))


@pytest.mark.parametrize("name, content, says", [
    ("t.json", b"not json", "not valid JSON"),
    ("t.json", b'{"events": []}', "no traceEvents list"),
    ("t.json", b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 1}]}', "without a thread"),
    ("t.json", b'{"traceEvents": [], "a": 1, "a": 2}', "given twice"),
    ("t.json", b'{"traceEvents": [{"ts": NaN}]}', "not a finite number"),
    ("t.json.gz", b"\x1f\x8b broken", "not a gzipped Chrome trace"),
    ("t.json.gz", b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"\xff" * 40,
     "not a gzipped Chrome trace"),  # zlib: invalid block type
    ("t.json.gz", gzip.compress(b"\xff\xfe"), "not UTF-8 text once unzipped"),
])
def test_a_file_that_is_no_trace_is_one_line_and_exit_2(tmp_path, capsys, name, content, says):
    path = tmp_path / name
    path.write_bytes(content)
    assert host_ops.main([str(path), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(path) in err and says in err and "\n" not in err


def test_a_gzipped_trace_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress("\ufeff".encode() + b'{"traceEvents": []}'))
    assert host_ops.from_chrome_trace(path) == []


def test_missing_folder_and_oversized_traces_are_refused(tmp_path, monkeypatch):
    (tmp_path / "d.json.gz").mkdir()
    (tmp_path / "d.json").mkdir()
    for name, says in (("none.json.gz", "no such file"), ("d.json.gz", "not a regular file"),
                       ("none.json", "no such file"), ("d.json", "is a folder")):
        with pytest.raises(TrainplanError, match=says):
            host_ops.from_chrome_trace(tmp_path / name)
    events = [{"ph": "X", "cat": "cpu_op", "name": "x" * 50, "tid": 1, "ts": 0, "dur": 1}] * 40
    monkeypatch.setattr(host_ops, "MAX_TRACE_BYTES", 1000)  # 40 events: ~4 KB of JSON
    with pytest.raises(TrainplanError, match="once unzipped; record fewer steps"):
        host_ops.from_chrome_trace(_trace(tmp_path, events, "big.json.gz"))
    with pytest.raises(TrainplanError, match="too large"):
        host_ops.from_chrome_trace(_trace(tmp_path, events, "big.json"))


def test_steps_below_one_are_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        host_ops.main(["x.json", "--steps", "0"])
    assert e.value.code == 2 and "use a whole number >= 1" in capsys.readouterr().err
