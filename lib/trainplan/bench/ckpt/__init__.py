"""Distributed checkpointing (DCP), its manifest, faults and the checkpoint benchmark."""
