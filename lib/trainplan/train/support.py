"""What the trainer (and the proxy harness it shares its layouts with) can run: a plan's
`runnable` flag and the reason where it is not. Plain Python, no torch at import."""

from __future__ import annotations

RUNNABLE_PINS = {"ep": 1}  # the search's degrees the trainer has no code for yet


def not_runnable(parallel: dict, model) -> str | None:
    """Why the trainer cannot run `parallel` (a plan's layout) of `model` (a ModelSpec), or
    None where it can."""
    if getattr(model, "is_moe", False):
        return (f"{model.name} is a mixture of experts; the trainer builds dense models "
                "only (n_experts = 1)")
    if int(parallel.get("ep", 1)) > 1:
        return "expert parallel is not in the trainer yet"
    if parallel.get("precision", "bf16") == "fp8" and int(parallel.get("tp", 1)) > 1:
        return ("fp8 with tensor parallel is not in the trainer yet (torchao's float8 "
                "tensor-parallel plans)")
    return None  # context parallel runs (GPU only: the launch and the harness refuse it on CPU)
