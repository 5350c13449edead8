"""trainplan: plan a distributed training job, prove it on GPUs, publish a runbook."""

__version__ = "0.2.0"
