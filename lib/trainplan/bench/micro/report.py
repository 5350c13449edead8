"""The table `python -m trainplan.bench.micro.run` prints when it is done: a row per record."""

from __future__ import annotations

from trainplan.bench.micro.shapes import GiB, KiB

MODEL_BENCHES = ("hbm", "head", "block", "optimizer", "overlap")  # the model's own pieces


def summary(record: dict) -> tuple[str, str, str, str]:
    c, r = record["config"], record["results"]
    if record["bench"] in ("matmul", "matmul-fp8"):
        recipe = f" {c['recipe']}" if "recipe" in c else ""
        return record["bench"], f"{c['name']} {c['m']}x{c['n']}x{c['k']}{recipe}", \
            f"{r['time_s'] * 1e3:.3f} ms", f"{r['tflops']:.1f} TFLOP/s"
    if record["bench"] == "fp8-linear":  # fwd + bwd of one converted linear, bf16 beside it
        return record["bench"], f"{c['name']} {c['m']}x{c['n']}x{c['k']} {c['recipe']}", \
            f"{r['time_s'] * 1e3:.3f} ms", f"{c['bf16_time_s'] / r['time_s']:.2f}x bf16"
    if record["bench"] == "block-fp8":  # a block in fp8, its bf16 twin's kept bytes beside
        return record["bench"], f"micro_batch={c['micro_batch']} {c['recipe']} {c['precision']}", \
            f"{r['time_s'] * 1e3:.3f} ms", \
            f"{r['activation_bytes'] / 2**20:.0f} MiB kept (bf16 " \
            f"{c['bf16_activation_bytes'] / 2**20:.0f})"
    if record["bench"] == "attention":
        return "attention", f"b{c['batch']} a{c['heads']} s{c['seq']} d{c['head_dim']}", \
            f"{r['time_s'] * 1e3:.3f} ms", f"{r['tflops']:.1f} TFLOP/s (causal)"
    if record["bench"] in MODEL_BENCHES:
        r = record["results"]
        rate = {"hbm": lambda: f"{r['tbps']:.2f} TB/s",
                "optimizer": lambda: f"{r['params_per_s'] / 1e9:.2f} Gparam/s",
                "overlap": lambda: f"{r['exposed_fraction']:.2f} of all-reduce exposed"}.get(
            record["bench"], lambda: f"{r['tokens_per_s'] / 1e3:.1f}k tok/s, "
                                     f"{r.get('activation_bytes', 0) / 2**20:.0f} MiB kept")()
        shape = " ".join(f"{k}={c[k]}" for k in ("micro_batch", "compile", "recompute",
                                                  "precision", "wrapper", "tp", "zero",
                                                  "optimize_ddp", "params",
                                                  "size_bytes", "world") if k in c)
        t = r.get("time_s")
        return record["bench"], shape, f"{t * 1e3:.3f} ms" if t else "-", rate
    size = next((f"{c['size_bytes'] / scale:g} {unit}" for unit, scale in
                 (("GiB", GiB), ("MiB", 2**20), ("KiB", KiB)) if c["size_bytes"] >= scale),
                f"{c['size_bytes']} B")
    return record["bench"], f"{size} x {c['world']} ranks", \
        f"{r['time_s'] * 1e6:.1f} us", f"{r['busbw_gbps']:.3g} GB/s busbw"


def print_table(records: list[dict], out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"microbenchmarks -> {out}")
    for column in ("bench", "shape", "time (median)", "rate"):
        table.add_column(column)
    for record in records:
        table.add_row(*summary(record))
    Console().print(table)
