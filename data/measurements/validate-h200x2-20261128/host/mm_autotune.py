# Throwaway: cuBLAS (torch.mm) against Inductor's max-autotune GEMM choice, at the 1.3B
# model's shapes at micro-batch 16 x seq 2048 (forward, grad-input and grad-weight GEMMs).
import time, torch, torch._inductor.config as ic
ic.max_autotune_gemm_backends = "ATEN,TRITON"
T, h, f, v = 32768, 2048, 5504, 32000
shapes = {"qkvo fwd": (T, h, h), "gate_up fwd": (T, h, f), "down fwd": (T, f, h), "output fwd": (T, h, v),
          "gate_up dgrad": (T, f, h), "down dgrad": (T, h, f), "output dgrad": (T, v, h),
          "qkvo wgrad": (h, T, h), "gate_up wgrad": (f, T, h), "down wgrad": (h, T, f), "output wgrad": (v, T, h)}
def bench(fn, a, b, n=30):
    for _ in range(5): fn(a, b)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn(a, b)
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n
mm = torch.compile(lambda a, b: a @ b, mode="max-autotune-no-cudagraphs", dynamic=False)
print(torch.cuda.get_device_name(), torch.__version__)
tot_a = tot_c = 0
for name, (m, k, n) in shapes.items():
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ta = bench(torch.mm, a, b); tc = bench(mm, a, b)
    fl = 2 * m * n * k
    tot_a += ta; tot_c += tc
    print(f"{name:14s} m{m} k{k} n{n}: cublas {fl/ta/1e12:6.1f} TF/s  autotuned {fl/tc/1e12:6.1f} TF/s  ratio {ta/tc:.3f}", flush=True)
print(f"sum of times: cublas {tot_a*1e3:.2f} ms, autotuned {tot_c*1e3:.2f} ms, ratio {tot_a/tot_c:.3f}")
