"""Launch artefacts: torchrun command, Slurm batch script, Kubernetes manifest."""
