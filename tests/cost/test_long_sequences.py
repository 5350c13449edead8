"""Long sequences and context parallel, as microbenchmarks price them.

Attention's rate grows with the sequence (`compute.attention_efficiency_at`, the calibration's
`attention_curve`), and torch's ring attention costs the host a measured time per block and
ring step (`measured.ring_host_time`, the calibration's `ring_host_s`). Both are fitted from
microbenchmark records (`calibrate.fit.attention_curve`, `calibrate.host.ring_host_scales`),
and both leave a calibration without them, and a layout without cp, exactly as before.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import easy_cluster, easy_gpu, layouts, tiny_model
from trainplan.calibrate import fit
from trainplan.calibrate.host import ring_host_scales
from trainplan.cost import compute, measured, step_time
from trainplan.errors import SpecError


def _attn(seq, tflops, causal=True):
    return {"config": {"seq": seq, "causal": causal, "batch": 1, "heads": 8, "head_dim": 128},
            "results": {"time_s": 1e-3, "tflops": tflops}}


def _ring(seq, cp, compiled, ring_s, plain_s):
    return {"config": {"seq": seq, "cp": cp, "compile": compiled},
            "results": {"time_s": ring_s, "plain_s": plain_s, "ring_extra_s": 0.0}}


def test_attention_rate_interpolates_in_log_seq_and_holds_flat_beyond():
    gpu = easy_gpu(attention_curve=((1024.0, 0.4), (4096.0, 0.8)))
    assert compute.attention_efficiency_at(gpu, 1024) == pytest.approx(0.4)
    assert compute.attention_efficiency_at(gpu, 2048) == pytest.approx(0.6)  # halfway in log
    assert compute.attention_efficiency_at(gpu, 256) == pytest.approx(0.4)
    assert compute.attention_efficiency_at(gpu, 65536) == pytest.approx(0.8)
    assert compute.attention_efficiency_at(easy_gpu(), 65536) == 0.25  # no curve: the fraction


def test_a_curve_speeds_up_long_sequences_only_where_measured_faster():
    m, L = tiny_model(), layouts(dp=1, micro_batch=1)
    flat = step_time.evaluate(m, easy_gpu(), easy_cluster(), L, seq_len=4096)
    same = step_time.evaluate(m, easy_gpu(attention_curve=((64.0, 0.25), (8192.0, 0.25))),
                              easy_cluster(), L, seq_len=4096)
    faster = step_time.evaluate(m, easy_gpu(attention_curve=((64.0, 0.25), (4096.0, 0.5))),
                                easy_cluster(), L, seq_len=4096)
    assert same["step_time_s"].iloc[0] == pytest.approx(flat["step_time_s"].iloc[0])
    assert faster["step_time_s"].iloc[0] < flat["step_time_s"].iloc[0]


def test_the_curve_is_fitted_per_length_and_only_from_several_lengths():
    peak = 1000.0
    one = [_attn(2048, 300.0), _attn(2048, 340.0)]
    assert fit.attention_curve(one, peak) == []
    recs = one + [_attn(8192, 450.0), _attn(512, 200.0, causal=False)]
    # dense-equivalent: causal rates count twice the work done
    assert fit.attention_curve(recs, peak) == [[512.0, 0.2], [2048.0, 0.64], [8192.0, 0.9]]
    # the scalar stays the shortest length's, as a calibration of one length had it
    assert fit.attention_fraction(recs, peak)["fraction"] == pytest.approx(0.2)


@pytest.mark.parametrize("rows", [((2048.0, 0.5), (1024.0, 0.6)), ((2048.0, 1.5),),
                                  ((2048.0,),), ((0.0, 0.5),)])
def test_a_malformed_curve_is_one_spec_error(rows):
    with pytest.raises(SpecError, match="attention_curve"):
        easy_gpu(attention_curve=rows)


def test_ring_host_is_fitted_from_host_bound_lengths_only():
    recs = [_ring(256, 2, True, 2.4e-3, 0.9e-3), _ring(1024, 2, True, 2.6e-3, 1.2e-3),
            _ring(8192, 2, True, 9.0e-3, 2.0e-3),  # GPU-bound: not host time
            _ring(256, 2, False, 4.4e-3, 0.5e-3)]
    assert ring_host_scales(recs) == {"ring_host_s": [[2, 0, 0.0039], [2, 1, 0.00145]]}
    assert ring_host_scales([recs[2]]) == {}


def test_ring_host_time_scales_with_ring_steps_and_is_zero_without_cp():
    gpu = easy_gpu(ring_host_s=((2, 1, 1.5e-3), (2, 0, 4.0e-3)))
    assert measured.ring_host_time(gpu, 1, True) == 0.0
    assert measured.ring_host_time(gpu, 2, True) == pytest.approx(1.5e-3)
    assert measured.ring_host_time(gpu, 4, True) == pytest.approx(4.5e-3)  # 3 steps
    assert measured.ring_host_time(gpu, 2, False) == pytest.approx(4.0e-3)
    np.testing.assert_allclose(measured.ring_host_time(gpu, np.array([1, 2]), True),
                               [0.0, 1.5e-3])
    assert measured.ring_host_time(easy_gpu(), 4, True) == 0.0


def test_ring_host_lifts_a_host_bound_cp_step_and_nothing_else():
    m = tiny_model()
    host = dict(host_block_s=(("fsdp2", 1e-3), ("plain", 1e-3)), host_overlap_k=3.5)
    gpu, with_ring = easy_gpu(**host), easy_gpu(**host, ring_host_s=((2, 1, 5e-3),))
    cp = layouts(dp=1, cp=2, zero=3, micro_batch=1)
    plain = layouts(dp=2, zero=3, micro_batch=1)
    a, b = (step_time.evaluate(m, g, easy_cluster(), cp, seq_len=64) for g in (gpu, with_ring))
    assert b["step_time_s"].iloc[0] > a["step_time_s"].iloc[0]
    c, d = (step_time.evaluate(m, g, easy_cluster(), plain, seq_len=64)
            for g in (gpu, with_ring))
    assert d["step_time_s"].iloc[0] == c["step_time_s"].iloc[0]
