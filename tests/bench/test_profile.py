"""The profiling entry: kernel names land in the right buckets; a CPU run writes its file."""

from __future__ import annotations

import json

import pytest
import torch

from trainplan.bench import profile


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


def test_cpu_run_writes_the_breakdown(tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text("n_layers: 2\nhidden: 64\nn_heads: 4\nffn: 128\nvocab: 256\n")
    out = tmp_path / "prof.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = profile.main(["--profile-out", str(out), "--active", "2", "--model", str(model),
                             "--seq-len", "16", "--steps", "5", "--warmup", "1",
                             "--synthetic", "--cpu", "--json"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    got = json.loads(out.read_text())
    assert got["active_steps"] == 2 and got["step_time_s"] > 0
    assert got["busy_s"] == pytest.approx(sum(got["buckets_s_per_step"].values()))
    assert got["model"] and got["gpus"] == 0 and got["seq_len"] == 16 and got["provenance"]
    from trainplan import trace_split  # the page's reader accepts what the profiler writes

    prof = trace_split.load(out)
    assert prof["layout"] == got["layout"] and prof["card"] == "cpu"
    assert trace_split.measured_split(prof).step_s > 0
    from trainplan.bench import step, train

    assert step.train_step.__name__ == "train_step" and train._summarise.__name__ == "_summarise"
