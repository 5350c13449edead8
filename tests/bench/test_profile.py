"""The profiling entry: kernel names land in the right buckets; a CPU run writes its file."""

from __future__ import annotations

import json

import pytest
import torch

from trainplan.bench.observe import profile


@pytest.mark.parametrize("kernel, bucket", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "collectives"),
    ("void at::native::(anonymous namespace)::fused_adam_kernel", "optimizer"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise_fused"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor>", "other"),
])
def test_buckets(kernel, bucket):
    assert profile.bucket_of(kernel) == bucket


def _profiled(tmp_path, vocab: int, *flags) -> dict:
    """One tiny CPU run of the profiling entry (one thread, as a rank); its JSON file."""
    model = tmp_path / "tiny.yaml"
    model.write_text(f"n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 128\nvocab: {vocab}\n")
    out = tmp_path / "prof.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = profile.main(["--profile-out", str(out), "--active", "2", "--model", str(model),
                             "--seq-len", "16", "--warmup", "1", "--cpu", "--json", *flags])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return json.loads(out.read_text())


def test_cpu_run_writes_the_breakdown(tmp_path):
    got = _profiled(tmp_path, 256, "--steps", "5", "--synthetic")
    assert got["active_steps"] == 2 and got["step_time_s"] > 0
    assert got["busy_s"] == pytest.approx(sum(got["buckets_s_per_step"].values()))
    assert got["model"] and got["gpus"] == 0 and got["seq_len"] == 16 and got["provenance"]
    host = got["host"]  # the host's operators by thread: the main thread ran the matmuls
    assert host["steps"] == 2 and host["threads"][0]["self_s_per_step"] > 0
    assert any(o["name"] == "aten::mm" for t in host["threads"] for o in t["ops"])
    from trainplan.compare import trace_split  # the page's reader accepts what the profiler writes

    prof = trace_split.load(tmp_path / "prof.json")
    assert prof["layout"] == got["layout"] and prof["card"] == "cpu"
    assert trace_split.measured_split(prof).step_s > 0
    from trainplan.bench.harness import step, train

    assert step.train_step.__name__ == "train_step" and train.summarise.__name__ == "summarise"


def test_trace_out_writes_the_host_ops_by_thread(tmp_path):
    """--trace-out: the recorded steps' Chrome trace, gzipped by its name, with the host's
    operators (thread ids, durations) that the buckets leave out."""
    import gzip

    _profiled(tmp_path, 256, "--steps", "5", "--synthetic",
              "--trace-out", str(tmp_path / "trace.json.gz"))
    events = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::mm" for e in ops) and all("tid" in e and "dur" in e for e in ops)
    from trainplan.bench.observe import host_ops  # the trace reads back: its two steps, matmuls

    got = host_ops.summarise(host_ops.from_chrome_trace(tmp_path / "trace.json.gz"))
    assert got["steps"] == 2 and got["threads"][0]["self_s_per_step"] > 0
    assert any(o["name"] == "aten::mm" for t in got["threads"] for o in t["ops"])
    assert profile.rank_path("t/trace.json.gz", 2).as_posix() == "t/trace.rank2.json.gz"
    assert profile.rank_path("prof.json", 1).name == "prof.rank1.json"
    assert profile.rank_path("prof.v2.json", 1).name == "prof.v2.rank1.json"
    assert profile.rank_path(".prof.json", 3).name == ".prof.rank3.json"


@pytest.mark.parametrize("flags, says", [
    (["--profile-out", "no/such/dir/p.json"], "no folder no/such/dir to write it into"),
    (["--profile-out", "p.json", "--trace-out", "t.txt"], "a .json or .json.gz file"),
    (["--profile-out", "p.json", "--trace-out", "none/t.json.gz"], "no folder none"),
    (["--profile-out", "."], "a folder, not a file name"),
    (["--profile-out", "sub"], "a folder, not a file name"),  # an existing folder
    (["--profile-out", "p.json", "--trace-out", "sub/"], "a folder, not a file name"),
    (["--profile-out", "x" * 300 + ".json"], "too long"),
    (["--profile-out", "p.json", "--trace-out", "./p.json"], "the same file as --profile-out"),
])
def test_unwritable_outputs_are_refused_before_the_run(flags, says, capsys, tmp_path,
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert profile.main([*flags, "--model", "no-such-model"]) == 2  # before the model is read
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["sub"]  # nothing written


def test_cpu_trainer_run_writes_the_breakdown(tmp_path):
    """`--impl hf-trainer`: Trainer's step ends drive the schedule; the same file comes out."""
    pytest.importorskip("accelerate")
    got = _profiled(tmp_path, 512, "--impl", "hf-trainer", "--steps", "6", "--num-workers", "0")
    assert got["impl"] == "hf-trainer" and got["active_steps"] == 2
    assert len(got["step_times_s_profiled"]) == 2 and got["step_time_s"] > 0
    assert got["busy_s"] > 0  # the profiler recorded the Trainer's steps
    from trainplan.bench.harness import train

    assert train.summarise.__name__ == "summarise"


def test_annotations_are_not_counted():
    """key_averages() on GPU lists user annotations (the step, nccl: ranges, the optimizer
    step) as device events beside the kernels they enclose: summarise counts only kernels,
    by the event's is_user_annotation where set and by name where not (older torch)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(key, us, annotation=None):
        e = SimpleNamespace(key=key, device_type=DeviceType.CUDA, self_device_time_total=us,
                            self_cpu_time_total=0, count=1)
        if annotation is not None:
            e.is_user_annotation = annotation
        return e

    kernels = [ev("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 100),
               ev("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 40),
               ev("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>",
                  10, annotation=False)]
    annotations = [ev("ProfilerStep*", 500), ev("ProfilerStep#7", 500),
                   ev("nccl:all_gather_into_tensor_coalesced", 40),
                   ev("nccl:_reduce_scatter_base", 30), ev("nccl:all_reduce", 20),
                   ev("Optimizer.step#AdamW.step", 10),
                   ev("an annotation by attribute only", 70, annotation=True)]
    assert not any(profile.is_annotation(e) for e in kernels)
    assert all(profile.is_annotation(e) for e in annotations)
    got = profile.summarise(kernels + annotations, active=1)
    assert got["buckets_s_per_step"] == pytest.approx(
        {"matmul": 100e-6, "collectives": 40e-6, "optimizer": 10e-6})
    assert got["busy_s"] == pytest.approx(150e-6)
    assert [k["kernel"][:5] for k in got["top_kernels"]] == ["nvjet", "ncclD", "void "]


def test_every_rank_writes_its_own_buckets(tmp_path, monkeypatch):
    """With --every-rank a rank other than 0 writes its kernel buckets beside rank 0's file
    (pipeline stages run different kernels); without it, it writes nothing."""
    model = tmp_path / "tiny.yaml"
    model.write_text("n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 128\nvocab: 256\n")
    out = tmp_path / "prof.json"
    args = ["--profile-out", str(out), "--active", "2", "--model", str(model), "--seq-len", "16",
            "--steps", "5", "--warmup", "1", "--synthetic", "--cpu"]
    monkeypatch.setattr(profile, "_rank", lambda: 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert profile.main(args) == 0
        assert not out.exists() and not profile.rank_path(str(out), 1).exists()
        assert profile.main([*args, "--every-rank"]) == 0
    finally:
        torch.set_num_threads(threads)
    got = json.loads(profile.rank_path(str(out), 1).read_text())
    assert profile.rank_path(str(out), 1).name == "prof.rank1.json" and not out.exists()
    assert got["rank"] == 1 and got["active_steps"] == 2 and got["busy_s"] > 0
    assert got["busy_s"] == pytest.approx(sum(got["buckets_s_per_step"].values()))


def test_timeline_counts_overlap_once_and_finds_the_gaps():
    """A GEMM and an element-wise kernel overlapping on two streams, an NCCL receive beside
    them (not compute), then a gap in which only the receive runs."""
    ms = 1_000_000
    kernels = [
        (7, 0 * ms, 4 * ms, "nvjet_hsh_128x256"),           # compute stream
        (9, 2 * ms, 5 * ms, "triton_poi_fused_add_0"),      # side stream, overlaps 2-4
        (11, 5 * ms, 8 * ms, "ncclDevKernel_SendRecv"),     # waiting: not compute
        (7, 8 * ms, 10 * ms, "nvjet_hsh_128x256"),
    ]
    t = profile.timeline(kernels)
    assert t["window_s"] == pytest.approx(0.010)
    assert t["compute_busy_s"] == pytest.approx(0.007)  # 0-5 ms and 8-10 ms, overlap once
    assert t["compute_idle_s"] == pytest.approx(0.003)
    assert t["compute_idle_share"] == pytest.approx(0.3)
    assert t["stream_busy_s"] == pytest.approx({"7": 0.006, "9": 0.003, "11": 0.003})
    assert t["compute_gaps"] == [{"at_s": pytest.approx(0.005), "s": pytest.approx(0.003),
                                  "after": "triton_poi_fused_add_0", "before": "nvjet_hsh_128x256"}]
    assert profile.timeline([]) == {}
    assert profile.union_s([(0, 10), (2, 3), (5, 12), (20, 21)]) == pytest.approx(13e-9)
