"""What `cost.ring` predicts the ring-attention microbenchmark (`bench.micro.ring`) measures.

Writes one JSON line per (model, seq, cp, mode): the ring's seconds beyond a rank's share of
plain SDPA (exposed collectives + HBM passes, one block, fwd + bwd) and its peak bytes over
its shards (`ring.micro_peak_bytes`, the benchmark's `peak_extra_bytes`), on
the card of `--gpu` with the calibration file `--calibration`, before the run.
Run: python tools/ring_predict.py --calibration FILE --model llama-1.3b --out FILE
"""

from __future__ import annotations

import argparse
import json

from trainplan.calibrate import store
from trainplan.cost import comms, compute, ring
from trainplan.specs import load_cluster, load_gpu_preset, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", required=True)
    p.add_argument("--gpu", default="h200-sxm")
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--seq-lens", default="8192,16384")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    gpu = store.apply(load_gpu_preset(a.gpu), store.load(a.gpu, a.calibration))
    cluster = comms.with_measured_links(load_cluster(a.cluster), gpu)
    with open(a.out, "a", encoding="utf-8") as f:
        for name in a.model:
            m = load_model(name)
            for seq in (int(s) for s in a.seq_lens.split(",")):
                tokens = a.micro_batch * seq / a.cp
                attn_fwd = tokens * compute.attention_flops_per_token_per_layer(m, seq, 1) / (
                    gpu.bf16_tflops * 1e12 * compute.attention_efficiency_at(gpu, seq))
                for compiled in (False, True):
                    exposed, passes = ring.ring_layer_time(
                        m, gpu, cluster, seq_len=seq, micro_batch=a.micro_batch, cp=a.cp, tp=1,
                        recompute_full=False, compiled=compiled, attn_fwd_s=attn_fwd)
                    peak = ring.micro_peak_bytes(m, seq_len=seq, micro_batch=a.micro_batch,
                                                 cp=a.cp, tp=1, compiled=compiled)
                    row = {"model": m.name, "seq": seq, "cp": a.cp, "micro_batch": a.micro_batch,
                           "compile": compiled, "exposed_s": float(exposed),
                           "passes_s": float(passes), "ring_extra_s": float(exposed + passes),
                           "share_s": float(3 * attn_fwd), "peak_extra_bytes": float(peak),
                           "calibration": gpu.calibration}
                    f.write(json.dumps(row) + "\n")
                    print(row)


if __name__ == "__main__":
    main()
